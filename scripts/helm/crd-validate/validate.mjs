// Validates CRD objects (a JSON array, file argv[3]) with the @kubernetes-models classes
// installed under argv[2] (node_modules). Structural: types, enums, required fields. The
// CRDs' own schemas allow unknown fields, so unknown keys are not reported.
// Exits 1 when an object fails or is of a kind it has no model for.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, file] = process.argv.slice(2);
const models = {
  "keda.sh/v1alpha1/ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js",
  "keda.sh/v1alpha1/TriggerAuthentication": "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication.js",
  "monitoring.coreos.com/v1/ServiceMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js",
  "monitoring.coreos.com/v1/PodMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor.js",
};
let failed = 0;
for (const { source, object } of JSON.parse(readFileSync(file, "utf8"))) {
  const key = `${object.apiVersion}/${object.kind}`;
  const what = `${source}: ${object.kind}/${object.metadata?.name}`;
  if (!models[key]) {
    console.log(`ERROR ${what}: no model for ${key}`);
    failed++;
    continue;
  }
  const mod = await import(pathToFileURL(join(modules, models[key])).href);
  const Model = mod[object.kind];
  try {
    new Model(object).validate();
  } catch (err) {
    console.log(`ERROR ${what}: ${err.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
