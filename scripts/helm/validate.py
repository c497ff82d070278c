"""Strict schema validation of rendered chart output (scripts/helm/check.sh runs it).

Every built-in object is validated with kubernetes-validate in strict mode (unknown fields
are errors) against each Kubernetes version in KUBE_VERSIONS; a built-in kind with no schema
is an error, not a warning. CRD objects (KEDA, prometheus-operator) go to
crd-validate/validate.mjs, which checks them against their CRDs' schemas.

usage: python validate.py NODE_MODULES_DIR RENDERED.yaml...
"""

import json
import os
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

# The oldest version the chart supports (Chart.yaml kubeVersion) and the newest schemas bundled.
KUBE_VERSIONS = ["1.30", "1.35"]
CRD_GROUPS = {"keda.sh", "monitoring.coreos.com"}


def main() -> int:
    modules, files = sys.argv[1], sys.argv[2:]
    problems, builtin, crds = [], 0, []
    for path in files:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        if not docs:
            problems.append(f"{path}: rendered no objects")
        for doc in docs:
            what = f"{os.path.basename(path)}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            group = doc.get("apiVersion", "").split("/")[0]
            if group in CRD_GROUPS:
                crds.append({"source": os.path.basename(path), "object": doc})
                continue
            builtin += 1
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.SchemaNotFoundError:
                    problems.append(f"{what}: no schema for {doc.get('apiVersion')} {doc.get('kind')} in Kubernetes {version}")
                except kubernetes_validate.ValidationError as err:
                    location = "/".join(str(p) for p in err.path)
                    problems.append(f"{what} (Kubernetes {version}) at {location or '.'}: {err.message}")
    if crds:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(crds, f)
        here = os.path.dirname(os.path.abspath(__file__))
        result = subprocess.run(
            ["node", os.path.join(here, "crd-validate", "validate.mjs"), modules, f.name],
            capture_output=True, text=True, check=False,
        )
        os.unlink(f.name)
        if result.returncode != 0:
            problems.extend(line for line in (result.stdout + result.stderr).splitlines() if line.strip())
            if not (result.stdout + result.stderr).strip():
                problems.append(f"CRD validation exited {result.returncode} without a message")
    for p in problems:
        print(p if p.startswith("ERROR ") else f"ERROR {p}")
    if problems:
        print(f"FAIL schema validation: {len(problems)} problems")
        return 1
    print(f"ok   schema validation: {builtin} objects valid (strict) against Kubernetes "
          f"{', '.join(KUBE_VERSIONS)}; {len(crds)} CRD objects valid against their CRDs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
