"""test_device_plugin.py - gmb-device-plugin against a test kubelet.

The kubelet cannot run here, so this plays its side with a real gRPC
implementation (Debian's python3-grpcio) on the plugin's own .proto files,
read as the descriptor set the build writes (build/gen/k8s/kubelet.desc):
the Registration service on DIR/kubelet.sock, the pod-resources service on
its socket, and the calls a kubelet makes to the plugin (ListAndWatch,
GetPreferredAllocation, Allocate, ...).  The brokers are real gmb-broker
processes, one per GPU of the fake CUDA driver (tests/fakecuda), in the
per-GPU run-dir layout (RUN_DIR/UUID) that gmbctl --gpu and the plugin
read.  Jobs are real clients (build/examples/job).

There is no container runtime here: a job gets the environment Allocate
returned with each container path replaced by the host path its mount
names, which is what a runtime's bind mount makes of it.

Usage: python3 test_device_plugin.py BUILD_DIR.  Prints "ok - NAME" per
check; the first failure raises and ends it with status 1.
"""
import hashlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

B = os.path.abspath(sys.argv[1])
WAIT = 20.0  # seconds for anything the plugin does on its own
UNIT = 64 << 20
UUID = ["GPU-46414b45-4355-4441-0000-00000000000%d" % i for i in range(10)]

fds = descriptor_pb2.FileDescriptorSet.FromString(
    open(os.path.join(B, "gen/k8s/kubelet.desc"), "rb").read())
pool = descriptor_pool.DescriptorPool()
for f in fds.file:
    pool.Add(f)
_factory = message_factory.MessageFactory(pool)


def msg(name):
    return _factory.GetPrototype(pool.FindMessageTypeByName(name))


Empty = msg("v1beta1.Empty")
RegisterRequest = msg("v1beta1.RegisterRequest")
DevicePluginOptions = msg("v1beta1.DevicePluginOptions")
ListAndWatchResponse = msg("v1beta1.ListAndWatchResponse")
PreferredAllocationRequest = msg("v1beta1.PreferredAllocationRequest")
PreferredAllocationResponse = msg("v1beta1.PreferredAllocationResponse")
AllocateRequest = msg("v1beta1.AllocateRequest")
AllocateResponse = msg("v1beta1.AllocateResponse")
ListPodResourcesRequest = msg("v1.ListPodResourcesRequest")
ListPodResourcesResponse = msg("v1.ListPodResourcesResponse")
# The services are in the descriptor set too: the method paths come from it.
REG = pool.FindServiceByName("v1beta1.Registration")
DP = pool.FindServiceByName("v1beta1.DevicePlugin")
PR = pool.FindServiceByName("v1.PodResourcesLister")
assert [m.name for m in DP.methods] == [
    "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation",
    "Allocate", "PreStartContainer"]


def ok(name):
    print("ok - " + name, flush=True)


def wait_for(what, fn, timeout=WAIT):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


class Kubelet:
    """The kubelet's side: Registration, pod-resources, and a client of the
    plugin that keeps its ListAndWatch stream open, as the kubelet does."""

    def __init__(self, kdir, pr_sock):
        self.kdir = kdir
        self.pr_sock = pr_sock
        self.registrations = queue.Queue()
        self.lists = []  # every ListAndWatchResponse received, in order
        self.list_sizes = []
        self.cv = threading.Condition()
        self.pods = {}  # pod name -> [device ids]
        self.pr_fail = False
        self.reg_server = None
        self.channel = None
        self.pr_server = self._serve_pod_resources()

    def _serve_pod_resources(self):
        def list_(req, ctx):
            if self.pr_fail:
                ctx.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
            r = ListPodResourcesResponse()
            for name, ids in list(self.pods.items()):
                p = r.pod_resources.add(name=name, namespace="default")
                c = p.containers.add(name="main")
                c.devices.add(resource_name="gmb.io/memory", device_ids=ids)
                c.devices.add(resource_name="nvidia.com/gpu",
                              device_ids=["GPU-x"])
            return r
        s = grpc.server(futures.ThreadPoolExecutor(4))
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(
                list_, request_deserializer=ListPodResourcesRequest.FromString,
                response_serializer=lambda m: m.SerializeToString())}),))
        s.add_insecure_port("unix:" + self.pr_sock)
        s.start()
        return s

    def start(self):
        """Serves Registration on kdir/kubelet.sock (made anew)."""
        def register(req, ctx):
            self.registrations.put(req)
            # As the kubelet: answer, then connect to the plugin apart.
            threading.Thread(target=self._connect, args=(req.endpoint,),
                             daemon=True).start()
            return Empty()
        s = grpc.server(futures.ThreadPoolExecutor(4))
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "v1beta1.Registration", {"Register": grpc.unary_unary_rpc_method_handler(
                register, request_deserializer=RegisterRequest.FromString,
                response_serializer=lambda m: m.SerializeToString())}),))
        s.add_insecure_port("unix:" + os.path.join(self.kdir, "kubelet.sock"))
        s.start()
        self.reg_server = s

    def stop(self):
        """A kubelet that stops: its server goes, and at its next start it
        deletes every socket in the directory (the plugin's too)."""
        if self.reg_server:
            self.reg_server.stop(0).wait()
            self.reg_server = None
        if self.channel:
            self.channel.close()
            self.channel = None
        for f in os.listdir(self.kdir):
            os.unlink(os.path.join(self.kdir, f))

    def _connect(self, endpoint):
        ch = grpc.insecure_channel("unix:" + os.path.join(self.kdir, endpoint))
        self.channel = ch
        opts = self.unary(ch, "GetDevicePluginOptions", Empty(),
                          DevicePluginOptions)
        self.options = opts
        law = ch.unary_stream("/v1beta1.DevicePlugin/ListAndWatch",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=lambda b: (b, ListAndWatchResponse.FromString(b)))
        try:
            for raw, r in law(Empty()):
                with self.cv:
                    self.lists.append(r)
                    self.list_sizes.append(len(raw))
                    self.cv.notify_all()
        except grpc.RpcError:
            pass  # the plugin stopped, or we did

    def unary(self, ch, method, req, resp_type, raw=None):
        call = ch.unary_unary("/v1beta1.DevicePlugin/" + method,
                              request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                              response_deserializer=resp_type.FromString)
        return call(raw if raw is not None else req, timeout=10)

    def call(self, method, req, resp_type, raw=None):
        ch = wait_for("the kubelet's channel to the plugin", lambda: self.channel)
        return self.unary(ch, method, req, resp_type, raw)

    def latest(self, pred=lambda r: True):
        def f():
            with self.cv:
                for r in reversed(self.lists):
                    return r if pred(r) else None
        return wait_for("a device list", f)

    def allocate(self, *containers):
        req = AllocateRequest()
        for ids in containers:
            req.container_requests.add(devices_ids=ids)
        return self.call("Allocate", req, AllocateResponse)


def health(r):
    out = {}
    for d in r.devices:
        key, _, n = d.ID.rpartition("_")
        out.setdefault(key, {})[int(n)] = d.health
    return out


class Node:
    """Brokers on fake GPUs, and the plugin."""

    def __init__(self, n_gpus, total, unit_flag, extra_conf=""):
        self.tmp = tempfile.mkdtemp(prefix="gmbk8s-")
        os.chmod(self.tmp, 0o755)
        self.base = os.path.join(self.tmp, "run")
        self.kdir = os.path.join(self.tmp, "device-plugins")
        self.state = os.path.join(self.tmp, "state")
        self.fakedev = os.path.join(self.tmp, "fakedev")
        for d in (self.base, self.kdir, self.fakedev):
            os.mkdir(d, 0o755)
        self.env = dict(os.environ)
        self.env.update({
            "GMB_LIBCUDA": os.path.join(B, "fakecuda/libcuda.so.1"),
            "FAKECUDA_TOTAL": total, "FAKECUDA_DEVICES": str(n_gpus),
            "FAKECUDA_DIR": self.fakedev, "GMB_RUN_DIR": self.base})
        for k in ("FAKECUDA_VISIBLE", "GMB_ENDPOINT", "GMB_TENANT",
                  "GMB_TOKEN", "GMB_TOKEN_FILE"):
            self.env.pop(k, None)
        self.n = n_gpus
        self.brokers = {}
        self.conf = os.path.join(self.tmp, "plugin.ini")
        with open(self.conf, "w") as f:
            f.write("[device-plugin]\nstate_dir = %s\npoll_ms = 100\n"
                    "gc_ms = 200\ngrace_s = 1\n%s" % (self.state, extra_conf))
        self.unit_flag = unit_flag
        self.plugin = None
        self.kubelet = Kubelet(self.kdir, os.path.join(self.tmp, "pr.sock"))

    def broker_start(self, i, config=None, timeout=WAIT):
        args = [os.path.join(B, "gmb-broker"), "--device", "cuda:%d" % i,
                "--run-dir", self.base, "--run-dir-per-gpu"]
        if config:
            args += ["--config", config]
        log = open(os.path.join(self.tmp, "broker%d.log" % i), "ab")
        p = subprocess.Popen(args, env=self.env, stdout=log, stderr=log)
        self.brokers[i] = p
        wait_for("broker %d" % i, lambda: os.path.exists(
            os.path.join(self.base, UUID[i], "admin.sock")) or p.poll() is not None,
            timeout)
        assert p.poll() is None, "broker %d did not start" % i

    def broker_stop(self, i):
        p = self.brokers.pop(i)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=WAIT) == 0

    def plugin_start(self):
        log = open(os.path.join(self.tmp, "plugin.log"), "ab")
        args = [os.path.join(B, "gmb-device-plugin"), "--config", self.conf,
                "--kubelet-dir", self.kdir, "--pod-resources",
                os.path.join(self.tmp, "pr.sock"), "--run-dir", self.base,
                "--run-dir-per-gpu"] + self.unit_flag
        self.plugin = subprocess.Popen(args, env=self.env, stdout=log,
                                       stderr=log)

    def plugin_stop(self):
        self.plugin.send_signal(signal.SIGTERM)
        rc = self.plugin.wait(timeout=WAIT)
        self.plugin = None
        assert rc == 0, "the plugin exited with %d" % rc

    def ctl(self, i, *args):
        r = subprocess.run([os.path.join(B, "gmbctl"), "--run-dir", self.base,
                            "--gpu", UUID[i], "--json"] + list(args),
                           env=self.env, capture_output=True, text=True,
                           timeout=WAIT)
        return r.returncode, r.stdout, r.stderr

    def capacity(self, i):
        rc, out, err = self.ctl(i, "status")
        assert rc == 0, err
        return json.loads(out)["capacity"]

    def tenant_exists(self, i, tenant):
        rc, out, err = self.ctl(i, "quota", "get", tenant)
        if rc == 0:
            return json.loads(out)
        assert "GMB_E_NOENT" in err, err
        return None

    def job(self, resp, *args, token_override=None):
        """A job with the container's environment, container paths mapped
        to the host paths their mounts name."""
        env = dict(self.env)
        for k in ("GMB_RUN_DIR", "GMB_ENDPOINT"):
            env.pop(k, None)
        mounts = {m.container_path: m.host_path for m in resp.mounts}
        # The directory the runtime makes for the socket mounts.
        mounts["/run/gmb"] = os.path.dirname(mounts["/run/gmb/broker.sock"])
        for k, v in resp.envs.items():
            for cpath in sorted(mounts, key=len, reverse=True):
                if cpath in v:
                    v = v.replace(cpath, mounts[cpath], 1)
                    break
            env[k] = v
        if token_override is not None:
            env.pop("GMB_TOKEN_FILE", None)
            env["GMB_TOKEN"] = token_override
        return subprocess.Popen([os.path.join(B, "examples/job")] + list(args),
                                env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def dump_logs(self):
        for f in sorted(os.listdir(self.tmp)):
            if f.endswith(".log"):
                print("--- %s" % f)
                with open(os.path.join(self.tmp, f), errors="replace") as h:
                    print(h.read()[-6000:])

    def close(self):
        if self.plugin:
            self.plugin.kill()
            self.plugin.wait()
        for p in self.brokers.values():
            p.kill()
            p.wait()
        self.kubelet.stop()
        self.kubelet.pr_server.stop(0)
        shutil.rmtree(self.tmp, ignore_errors=True)


def expect_error(code, text, fn):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, "%s: %s" % (e.code(), e.details())
        assert text in e.details(), e.details()
        return e.details()
    raise AssertionError("no error, %s wanted" % code)


def main_flow():
    node = Node(2, "512m", ["--unit", "64MiB"])
    try:
        flow(node)
    except BaseException:
        node.dump_logs()
        raise
    finally:
        node.close()


def flow(node):
    k = node.kubelet
    node.broker_start(0)
    node.broker_start(1)
    k.start()
    # The state directory as a hostPath DirectoryOrCreate leaves it (0755),
    # and a tokens/ directory that anyone may list.
    tokdir = os.path.join(node.state, "tokens")
    os.makedirs(tokdir)
    os.chmod(node.state, 0o755)
    os.chmod(tokdir, 0o755)
    node.plugin_start()

    # --- registration and the device list
    reg = k.registrations.get(timeout=WAIT)
    assert reg.version == "v1beta1" and reg.resource_name == "gmb.io/memory"
    assert reg.options.get_preferred_allocation_available
    assert os.path.exists(os.path.join(node.kdir, reg.endpoint))
    ok("registers v1beta1 gmb.io/memory on the kubelet's socket")
    want = {UUID[i]: node.capacity(i) // UNIT for i in (0, 1)}
    assert all(want.values()), want
    r = k.latest(lambda r: {k2: len(v) for k2, v in health(r).items()} == want)
    assert all(h == "Healthy" for v in health(r).values() for h in v.values())
    assert wait_for("options", lambda: getattr(k, "options", None)).get_preferred_allocation_available
    ok("ListAndWatch: capacity / unit units per GPU, all healthy (%s)" % want)

    ids0 = ["%s_%d" % (UUID[0], u) for u in range(want[UUID[0]])]
    ids1 = ["%s_%d" % (UUID[1], u) for u in range(want[UUID[1]])]

    # --- preferred allocation: one GPU, the best fit
    req = PreferredAllocationRequest()
    req.container_requests.add(available_deviceIDs=ids0[:2] + ids1,
                               allocation_size=2)
    req.container_requests.add(available_deviceIDs=ids0[:2] + ids1,
                               allocation_size=3)
    req.container_requests.add(available_deviceIDs=ids0 + ids1,
                               must_include_deviceIDs=[ids1[4]],
                               allocation_size=2)
    pr = k.call("GetPreferredAllocation", req, PreferredAllocationResponse)
    got = [list(c.deviceIDs) for c in pr.container_responses]
    assert got[0] == ids0[:2], got
    assert got[1] == ids1[:3], got
    assert got[2][0] == ids1[4] and got[2][1].startswith(UUID[1]), got
    ok("GetPreferredAllocation keeps a container to one GPU (best fit, "
       "must-include first)")

    # --- refusals
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "two GPUs",
                 lambda: k.allocate([ids0[0], ids1[0]]))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "unknown device id",
                 lambda: k.allocate(["nope_1"]))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "unknown device id",
                 lambda: k.allocate([UUID[0] + "_99999"]))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "twice",
                 lambda: k.allocate([ids0[0], ids0[0]]))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "does not decode",
                 lambda: k.call("Allocate", None, AllocateResponse,
                                raw=b"\xff\xff\xff\xff"))
    # A second container that fails undoes the first one's tenant.
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "unknown device id",
                 lambda: k.allocate([ids0[0]], ["nope_2"]))
    assert os.listdir(os.path.join(node.state, "tokens")) == []
    ok("Allocate refuses a mix of GPUs, unknown and repeated ids, garbage; "
       "nothing half-made")

    # --- allocation: a tenant, its environment and mounts
    a = k.allocate(ids0[2:4]).container_responses[0]
    k.pods["pod-a"] = ids0[2:4]
    env = dict(a.envs)
    tenant = env["GMB_TENANT"]
    assert tenant.startswith("k8s-"), env
    assert env["GMB_RUN_DIR"] == "/run/gmb", env
    assert env["GMB_ENDPOINT"] == "ipc:///run/gmb/broker.sock", env
    assert env["GMB_TOKEN_FILE"] == "/run/secrets/gmb/token", env
    assert "GMB_TOKEN" not in env
    mounts = {m.container_path: (m.host_path, m.read_only) for m in a.mounts}
    d0 = os.path.join(node.base, UUID[0])
    assert mounts["/run/gmb/broker.sock"] == (d0 + "/broker.sock", True), mounts
    assert mounts["/run/gmb/fd.sock"] == (d0 + "/fd.sock", True), mounts
    assert len(mounts) == 3, mounts  # never the admin socket
    tok_host = mounts["/run/secrets/gmb/token"][0]
    assert oct(os.stat(tok_host).st_mode & 0o777) == "0o644"
    # The token file is readable by any uid (the container's may be any),
    # so its name must be a secret: the tenant's name is not one (gmbctl
    # tenants, the broker's metrics and log, the pod's environment show
    # it), and tokens/ must not be listable.
    assert os.path.dirname(tok_host) == tokdir, tok_host
    name = os.path.basename(tok_host)
    assert tenant not in name, name
    assert len(name) == 64 and all(c in "0123456789abcdef" for c in name), name
    assert not os.path.exists(os.path.join(tokdir, tenant))
    assert oct(os.stat(tokdir).st_mode & 0o777) == "0o711"
    ok("the token file's name is no tenant's name, in a tokens/ only root "
       "may list (made so when it was not)")
    row = node.tenant_exists(0, tenant)
    assert row and row["quota"] == 2 * UNIT and row["reserve"] == 0, row
    ok("Allocate of 2 units: tenant %s with quota 2 x unit, the broker's "
       "two client sockets and the token file mounted read-only" % tenant)
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, "allocated already",
                 lambda: k.allocate([ids0[3], ids0[4]]))
    ok("Allocate refuses units allocated already")

    # --- a job with that environment, held to the quota
    j = node.job(a, "--touch", "64MiB", "32MiB")
    out, _ = j.communicate(timeout=WAIT)
    assert j.returncode == 0, out
    j = node.job(a, "64MiB", "64MiB", "64MiB")
    out, _ = j.communicate(timeout=WAIT)
    assert j.returncode == 3 and "QUOTA" in out.upper(), out
    j = node.job(a, "1MiB", token_override="not-the-token")
    out, _ = j.communicate(timeout=WAIT)
    assert j.returncode == 1 and "AUTH" in out.upper(), out
    ok("a job with the returned environment connects, is held to 2 units, "
       "a wrong token is refused")

    # --- the pod's end ends the tenant, once its sessions ended
    hold = node.job(a, "--hold-ms", "-1", "32MiB")
    wait_for("the holding job's session",
             lambda: (node.tenant_exists(0, tenant) or {}).get("used"))
    time.sleep(1.5)  # several collections with the pod listed
    assert node.tenant_exists(0, tenant)
    del k.pods["pod-a"]
    time.sleep(1.0)
    assert node.tenant_exists(0, tenant), "removed while a session holds it"
    hold.send_signal(signal.SIGTERM)
    hold.communicate(timeout=WAIT)
    wait_for("tenant removal", lambda: node.tenant_exists(0, tenant) is None)
    wait_for("token file removal", lambda: not os.path.exists(tok_host))
    ok("a pod gone from pod-resources: its tenant stays while a session "
       "holds it, then is removed with its token")
    a2 = k.allocate(ids0[2:4]).container_responses[0]
    k.pods["pod-a2"] = ids0[2:4]
    assert dict(a2.envs)["GMB_TENANT"] != tenant
    ok("the units of a gone pod are allocated again, to a new tenant")

    # --- pod-resources that does not answer removes nothing
    b = k.allocate(ids1[0:3]).container_responses[0]
    tb = dict(b.envs)["GMB_TENANT"]
    k.pods["pod-b"] = ids1[0:3]
    k.pr_fail = True
    del k.pods["pod-b"]
    time.sleep(1.5)
    assert node.tenant_exists(1, tb), "removed while pod-resources was away"
    k.pods["pod-b"] = ids1[0:3]
    k.pr_fail = False
    ok("no tenant is removed while pod-resources does not answer")

    # --- a broker down and back: health, refusal, tenants made again
    node.broker_stop(1)
    k.latest(lambda r: set(health(r)[UUID[1]].values()) == {"Unhealthy"}
             and set(health(r)[UUID[0]].values()) == {"Healthy"})
    expect_error(grpc.StatusCode.UNAVAILABLE, "down",
                 lambda: k.allocate(ids1[5:6]))
    ok("a broker down: its units unhealthy in ListAndWatch, Allocate on it "
       "refused")
    node.broker_start(1)
    k.latest(lambda r: set(health(r)[UUID[1]].values()) == {"Healthy"})
    wait_for("tenant made again", lambda: node.tenant_exists(1, tb))
    assert node.tenant_exists(1, tb)["quota"] == 3 * UNIT
    jb = node.job(b, "--touch", "100MiB")
    out, _ = jb.communicate(timeout=WAIT)
    assert jb.returncode == 0, out
    ok("the broker back: healthy again, its tenant made again with its "
       "token and quota")

    # --- the kubelet restarts: the plugin serves and registers again
    n_lists = len(k.lists)
    k.stop()
    time.sleep(0.5)
    k.start()
    reg2 = k.registrations.get(timeout=WAIT)
    assert reg2.resource_name == "gmb.io/memory"
    wait_for("a new device list", lambda: len(k.lists) > n_lists)
    assert node.tenant_exists(1, tb)
    ok("a kubelet restart (sockets deleted and made again): the plugin "
       "registers again, tenants kept")

    # --- the plugin restarts: its allocations are kept
    node.plugin_stop()
    assert node.tenant_exists(1, tb)
    # A token file an earlier version wrote, named after its tenant.
    legacy = os.path.join(tokdir, tb)
    with open(legacy, "w") as f:
        f.write("0" * 64)
    n_lists = len(k.lists)
    node.plugin_start()
    k.registrations.get(timeout=WAIT)
    wait_for("a device list", lambda: len(k.lists) > n_lists)
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, "allocated already",
                 lambda: k.allocate(ids1[1:2]))
    del k.pods["pod-b"]
    wait_for("tenant removal after the restart",
             lambda: node.tenant_exists(1, tb) is None)
    wait_for("the earlier version's token file removed",
             lambda: not os.path.exists(legacy))
    ok("a plugin restart keeps its allocations (state file) and still "
       "removes the tenants of pods that go")

    # --- hostile kubelet: garbage on the socket, a stream hung up
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(node.kdir, reg.endpoint))
    s.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(4096))
    s.close()
    ch = grpc.insecure_channel("unix:" + os.path.join(node.kdir, reg.endpoint))
    law = ch.unary_stream("/v1beta1.DevicePlugin/ListAndWatch",
                          request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=ListAndWatchResponse.FromString)
    it = law(Empty())
    next(it)
    it.cancel()
    un = ch.unary_unary("/v1beta1.DevicePlugin/NoSuchMethod",
                        request_serializer=lambda b: b,
                        response_deserializer=lambda b: b)
    expect_error(grpc.StatusCode.UNIMPLEMENTED, "", lambda: un(b"", timeout=10))
    ch.close()
    k.call("GetDevicePluginOptions", Empty(), DevicePluginOptions)
    assert node.plugin.poll() is None
    ok("garbage on the socket, a stream hung up, an unknown method: the "
       "plugin serves on")

    # --- a broker that refuses the tenant: its registry is full
    node.broker_stop(0)
    full = os.path.join(node.tmp, "full.ini")
    with open(full, "w") as f:
        for i in range(4095):
            f.write("[tenant:t%d]\nquota = 1MiB\nuids = 0\n" % i)
    node.broker_start(0, config=full, timeout=10 * WAIT)  # 4095 sections
    k.latest(lambda r: set(health(r)[UUID[0]].values()) == {"Healthy"})
    # Tenant a2 came back (the 4096th); a new one does not fit.
    wait_for("a2 made again", lambda: node.tenant_exists(
        0, dict(a2.envs)["GMB_TENANT"]))
    before = sorted(os.listdir(os.path.join(node.state, "tokens")))
    expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "as many tenants as it may",
                 lambda: k.allocate(ids0[5:6]))
    assert sorted(os.listdir(os.path.join(node.state, "tokens"))) == before
    k.call("GetDevicePluginOptions", Empty(), DevicePluginOptions)
    ok("a broker whose registry is full: RESOURCE_EXHAUSTED, nothing left "
       "behind, the plugin serves on")
    node.plugin_stop()


def reuse_flow():
    """A pod that ends within grace_s of its Allocate: the kubelet frees its
    units at once and may give them to the next pod (GetPreferredAllocation
    picks the same ones first).  The plugin, which keeps young allocations,
    must not refuse that pod: pod-resources no longer lists the units, so
    the earlier allocation is over.  Units a pod that pod-resources lists
    still holds stay refused."""
    node = Node(1, "512m", ["--unit", "64MiB"], extra_conf="grace_s = 3600\n")
    try:
        k = node.kubelet
        node.broker_start(0)
        k.start()
        node.plugin_start()
        k.registrations.get(timeout=WAIT)
        k.latest(lambda r: len(health(r).get(UUID[0], {})) > 0)
        ids = ["%s_%d" % (UUID[0], u) for u in range(4)]
        a = k.allocate(ids[0:2]).container_responses[0]
        ta = dict(a.envs)["GMB_TENANT"]
        k.pods["pod-short"] = ids[0:2]
        time.sleep(0.5)  # collections with the pod listed
        expect_error(grpc.StatusCode.FAILED_PRECONDITION, "allocated already",
                     lambda: k.allocate(ids[1:3]))
        del k.pods["pod-short"]
        b = k.allocate(ids[0:2]).container_responses[0]
        tb = dict(b.envs)["GMB_TENANT"]
        k.pods["pod-next"] = ids[0:2]
        assert tb != ta
        assert node.tenant_exists(0, tb)["quota"] == 2 * UNIT
        wait_for("the short pod's tenant removed",
                 lambda: node.tenant_exists(0, ta) is None)
        ok("units of a pod that ended within grace_s go to the next pod at "
           "once; the ended pod's tenant is removed")
        node.plugin_stop()
    except BaseException:
        node.dump_logs()
        raise
    finally:
        node.close()


def state_dir_flow():
    """A state directory, or tokens/ in it, that another uid owns or could
    write, or a symbolic link: the plugin would write tokens where that uid
    reads them, or replace files it chose.  It refuses to start."""
    if os.geteuid() != 0:
        print("ok - # SKIP the state directory's owner: needs root")
        return
    node = Node(1, "512m", ["--unit", "64MiB"])
    try:
        tokdir = os.path.join(node.state, "tokens")
        other = os.path.join(node.tmp, "elsewhere")
        os.mkdir(other, 0o711)
        cases = [
            ("state_dir owned by uid 65534",
             lambda: (os.mkdir(node.state, 0o755),
                      os.chown(node.state, 65534, 65534))),
            ("state_dir writable by others",
             lambda: (os.mkdir(node.state), os.chmod(node.state, 0o777))),
            ("tokens/ owned by uid 65534",
             lambda: (os.mkdir(node.state, 0o755), os.mkdir(tokdir, 0o711),
                      os.chown(tokdir, 65534, 65534))),
            ("tokens/ a symbolic link",
             lambda: (os.mkdir(node.state, 0o755), os.symlink(other, tokdir))),
        ]
        for what, make in cases:
            shutil.rmtree(node.state, ignore_errors=True)
            make()
            node.plugin_start()
            rc = node.plugin.wait(timeout=WAIT)
            node.plugin = None
            assert rc != 0, "%s: the plugin started" % what
            with open(os.path.join(node.tmp, "plugin.log")) as f:
                log = f.read()
            assert "writable by no one else" in log.splitlines()[-1], log
        assert os.listdir(other) == []
        ok("a state directory or tokens/ of another uid, writable by others "
           "or a symbolic link: the plugin refuses to start")
    except BaseException:
        node.dump_logs()
        raise
    finally:
        node.close()


def sizes_flow():
    """A full 8-GPU node (141 GiB each) at the default unit, and a
    reservation of half the quota configured."""
    node = Node(8, "141g", [], extra_conf="reserve = 50%\n")
    try:
        for i in range(8):
            node.broker_start(i)
        node.kubelet.start()
        node.plugin_start()
        node.kubelet.registrations.get(timeout=WAIT)
        caps = [node.capacity(i) for i in range(8)]
        total = sum(c // (1 << 30) for c in caps)
        r = node.kubelet.latest(lambda r: len(r.devices) == total)
        size = node.kubelet.list_sizes[-1]
        assert size < 4 * 1024 * 1024
        ids = [d.ID for d in r.devices if d.ID.startswith(UUID[7])]
        req = AllocateRequest()
        req.container_requests.add(devices_ids=ids)
        resp = node.kubelet.call("Allocate", req, AllocateResponse)
        node.kubelet.pods["pod-full"] = ids
        asize = len(resp.SerializeToString())
        row = node.tenant_exists(7, dict(resp.container_responses[0].envs)["GMB_TENANT"])
        assert row["quota"] == len(ids) << 30, row
        assert row["reserve"] == row["quota"] // 2, row
        ok("reserve = 50%%: the tenant of %d units has a reservation of half "
           "its quota" % len(ids))
        print("# sizes: 8 GPUs of %s, unit 1GiB: %d devices, ListAndWatch "
              "message %d bytes (%.1f%% of the kubelet's 4 MiB); Allocate "
              "request of %d units %d bytes, response %d bytes" %
              (caps[0], len(r.devices), size, 100.0 * size / (4 << 20),
               len(ids), len(req.SerializeToString()), asize))
        ok("a full 8-GPU node at the default unit: the device list is far "
           "below the 4 MiB limit")
        node.plugin_stop()
    except BaseException:
        node.dump_logs()
        raise
    finally:
        node.close()


if __name__ == "__main__":
    main_flow()
    reuse_flow()
    state_dir_flow()
    sizes_flow()
    print("test_device_plugin: all passed")
