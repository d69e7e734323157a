/*
 * error.c - names and sentences of the GMB_E_* codes, generated from the
 * one list in include/gmb.h, and gmb_version().
 */
#include "gmb.h"

GMB_EXPORT const char *gmb_strerror(int err) {
  switch (err) {
    case GMB_OK:
      return "success";
#define GMB_ERROR_TEXT_(name, code, text) \
  case GMB_E_##name:                      \
    return text;
    GMB_ERRORS(GMB_ERROR_TEXT_)
#undef GMB_ERROR_TEXT_
  }
  return "unknown error";
}

GMB_EXPORT const char *gmb_err_name(int err) {
  switch (err) {
    case GMB_OK:
      return "GMB_OK";
#define GMB_ERROR_NAME_(name, code, text) \
  case GMB_E_##name:                      \
    return "GMB_E_" #name;
    GMB_ERRORS(GMB_ERROR_NAME_)
#undef GMB_ERROR_NAME_
  }
  return "GMB_E_UNKNOWN";
}

GMB_EXPORT const char *gmb_version(void) { return GMB_VERSION_STRING; }
