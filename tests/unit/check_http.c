/*
 * check_http.c - the metrics endpoint alone: addresses it accepts and
 * refuses, what it answers before and after a publish, other paths and
 * methods, a busy port, IPv6.
 */
#include <arpa/inet.h>
#include <check.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check_main.h"
#include "gmb.h"
#include "http.h"

/* One HTTP/1.0 exchange; the status code (0: no answer), body in `body`. */
static int get(int family, uint16_t port, const char *method, const char *path,
               char *body, size_t cap) {
  int fd = socket(family, SOCK_STREAM, 0);
  ck_assert_int_ge(fd, 0);
  int rc;
  if (family == AF_INET6) {
    struct sockaddr_in6 a = {.sin6_family = AF_INET6,
                             .sin6_port = htons(port),
                             .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    rc = connect(fd, (struct sockaddr *)&a, sizeof a);
  } else {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    rc = connect(fd, (struct sockaddr *)&a, sizeof a);
  }
  if (rc != 0) {
    close(fd);
    return 0;
  }
  char req[256];
  int n = snprintf(req, sizeof req, "%s %s HTTP/1.0\r\n\r\n", method, path);
  ck_assert_int_eq(write(fd, req, (size_t)n), n);
  char resp[8192];
  size_t got = 0;
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 10000) <= 0) break;
    ssize_t r = read(fd, resp + got, sizeof resp - 1 - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  resp[got] = '\0';
  int code = 0;
  if (sscanf(resp, "HTTP/1.%*d %d", &code) != 1) return 0;
  const char *b = strstr(resp, "\r\n\r\n");
  snprintf(body, cap, "%s", b ? b + 4 : "");
  if (strstr(resp, "version=0.0.4") == NULL && code == 200) return -1;
  return code;
}

START_TEST(listen_parse_forms) {
  char host[64], err[256];
  uint16_t port;
  ck_assert_int_eq(gmb__http_listen_parse("127.0.0.1:9464", host, sizeof host,
                                          &port, err, sizeof err), 0);
  ck_assert_str_eq(host, "127.0.0.1");
  ck_assert_uint_eq(port, 9464);
  ck_assert_int_eq(gmb__http_listen_parse("[::1]:80", host, sizeof host, &port,
                                          err, sizeof err), 0);
  ck_assert_str_eq(host, "::1");
  ck_assert_uint_eq(port, 80);
  ck_assert_int_eq(gmb__http_listen_parse("localhost:0", host, sizeof host,
                                          &port, err, sizeof err), 0);
  ck_assert_uint_eq(port, 0);
}
END_TEST

START_TEST(listen_parse_refuses_bad_forms) {
  static const char *bad[] = {"9464",      ":9464",        "127.0.0.1:",
                              "1.2.3.4:x", "1.2.3.4:65536", "::1:9464",
                              "[::1]9464", "[::1",          "h:-1"};
  char host[64], err[256];
  uint16_t port;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    err[0] = '\0';
    ck_assert_msg(gmb__http_listen_parse(bad[i], host, sizeof host, &port, err,
                                         sizeof err) == GMB_E_INVAL,
                  "%s accepted", bad[i]);
    ck_assert_msg(strstr(err, bad[i]) != NULL, "reason '%s' does not name %s",
                  err, bad[i]);
  }
}
END_TEST

START_TEST(serves_only_what_was_published) {
  struct gmb_http *h = NULL;
  char err[256], body[4096];
  ck_assert_int_eq(gmb__http_start("127.0.0.1:0", &h, err, sizeof err), 0);
  uint16_t port = gmb__http_port(h);
  ck_assert_uint_gt(port, 0);
  ck_assert_int_eq(get(AF_INET, port, "GET", "/metrics", body, sizeof body),
                   503);
  gmb__http_publish(h, "# TYPE x gauge\nx 1\n");
  ck_assert_int_eq(get(AF_INET, port, "GET", "/metrics", body, sizeof body),
                   200);
  ck_assert_str_eq(body, "# TYPE x gauge\nx 1\n");
  gmb__http_publish(h, "x 2\n"); /* replaced, not appended */
  ck_assert_int_eq(get(AF_INET, port, "GET", "/metrics", body, sizeof body),
                   200);
  ck_assert_str_eq(body, "x 2\n");
  ck_assert_int_eq(get(AF_INET, port, "GET", "/", body, sizeof body), 404);
  ck_assert_int_eq(get(AF_INET, port, "GET", "/metricsx", body, sizeof body),
                   404);
  ck_assert_int_eq(get(AF_INET, port, "POST", "/metrics", body, sizeof body),
                   405);
  ck_assert_int_eq(get(AF_INET, port, "DELETE", "/metrics", body, sizeof body),
                   405);
  gmb__http_stop(h);
  /* Stopped: nothing listens there any more. */
  ck_assert_int_eq(get(AF_INET, port, "GET", "/metrics", body, sizeof body),
                   0);
}
END_TEST

START_TEST(busy_port_is_an_error_with_reason) {
  struct gmb_http *a = NULL, *b = NULL;
  char err[256], addr[64];
  ck_assert_int_eq(gmb__http_start("127.0.0.1:0", &a, err, sizeof err), 0);
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)gmb__http_port(a));
  ck_assert_int_eq(gmb__http_start(addr, &b, err, sizeof err), GMB_E_SYSTEM);
  ck_assert_ptr_null(b);
  ck_assert_msg(strstr(err, "in use") != NULL, "reason: %s", err);
  ck_assert_int_eq(gmb__http_start("127.0.0.1", &b, err, sizeof err),
                   GMB_E_INVAL);
  gmb__http_stop(a);
  gmb__http_stop(NULL);
}
END_TEST

START_TEST(ipv6_loopback) {
  int probe = socket(AF_INET6, SOCK_STREAM, 0);
  struct sockaddr_in6 a = {.sin6_family = AF_INET6,
                           .sin6_addr = IN6ADDR_LOOPBACK_INIT};
  int have = probe >= 0 && bind(probe, (struct sockaddr *)&a, sizeof a) == 0;
  if (probe >= 0) close(probe);
  if (!have) {
    fprintf(stderr, "check_http: no IPv6 loopback here; ipv6_loopback skipped\n");
    return;
  }
  struct gmb_http *h = NULL;
  char err[256], body[256];
  ck_assert_int_eq(gmb__http_start("[::1]:0", &h, err, sizeof err), 0);
  gmb__http_publish(h, "y 3\n");
  ck_assert_int_eq(get(AF_INET6, gmb__http_port(h), "GET", "/metrics", body,
                       sizeof body), 200);
  ck_assert_str_eq(body, "y 3\n");
  gmb__http_stop(h);
}
END_TEST

static Suite *http_suite(void) {
  Suite *s = suite_create("http");
  TCase *tc = tcase_create("http");
  tcase_add_test(tc, listen_parse_forms);
  tcase_add_test(tc, listen_parse_refuses_bad_forms);
  tcase_add_test(tc, serves_only_what_was_published);
  tcase_add_test(tc, busy_port_is_an_error_with_reason);
  tcase_add_test(tc, ipv6_loopback);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return check_run(http_suite()); }
