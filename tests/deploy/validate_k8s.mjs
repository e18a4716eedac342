// Validates every document of every YAML file under a directory (default deploy/k8s) against the
// Kubernetes API schema, offline, with the kubernetes-models classes: each document is loaded into the
// class matching its apiVersion/kind and .validate() is called. Unknown kinds are an error, so a new
// manifest cannot slip through unchecked. Exit status 1 on any error.
//   node validate_k8s.mjs DIR        (run by tests/deploy/validate.sh after `npm ci`)
import { readFileSync, readdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { createRequire } from "node:module";
import { parseAllDocuments } from "yaml";

const require = createRequire(import.meta.url);
const dir = resolve(process.argv[2] ?? new URL("../../deploy/k8s", import.meta.url).pathname);

// apiVersion "apps/v1" -> module path "kubernetes-models/apps/v1/<Kind>"; core "v1" -> "kubernetes-models/v1/<Kind>".
function modelFor(apiVersion, kind) {
  if (!/^[a-z0-9.\/]+$/.test(apiVersion) || !/^[A-Za-z]+$/.test(kind)) return null;
  try {
    const mod = require(`kubernetes-models/${apiVersion}/${kind}`);
    return mod[kind] ?? mod.default ?? null;
  } catch {
    return null;
  }
}

let errors = 0;
let checked = 0;
const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort();
if (files.length === 0) {
  console.error(`no YAML files in ${dir}`);
  process.exit(1);
}
for (const file of files) {
  const path = join(dir, file);
  const docs = parseAllDocuments(readFileSync(path, "utf8"));
  docs.forEach((doc, i) => {
    const where = `${file}[${i}]`;
    if (doc.errors.length) {
      console.error(`FAIL ${where}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      errors++;
      return;
    }
    const obj = doc.toJS();
    if (obj == null) return; // an empty document
    const Model = modelFor(obj.apiVersion ?? "", obj.kind ?? "");
    if (!Model) {
      console.error(`FAIL ${where}: no kubernetes-models class for apiVersion=${obj.apiVersion} kind=${obj.kind}`);
      errors++;
      return;
    }
    try {
      new Model(obj).validate();
      console.log(`ok   ${where}: ${obj.apiVersion} ${obj.kind} ${obj.metadata?.name ?? ""}`);
      checked++;
    } catch (e) {
      console.error(`FAIL ${where}: ${obj.kind} ${obj.metadata?.name ?? ""}: ${e.message}`);
      if (e.errors) for (const err of e.errors) console.error(`       ${err.instancePath} ${err.message}`);
      errors++;
    }
  });
}
console.log(`${checked} Kubernetes object(s) valid, ${errors} error(s)`);
process.exit(errors ? 1 : 0);
