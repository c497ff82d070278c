#!/usr/bin/env bash
# The Helm chart's checks, offline (`make helm-check`; `make test` runs it last):
#   1. yamllint of the values files (chart defaults, configs/helm/*.yaml, helm/tandem/ci/*.yaml)
#   2. helm lint --strict with the defaults and with each of those values files
#   3. helm template with each, then yamllint of the output; helm install --dry-run=client
#      (kubeVersion, NOTES.txt) with each; helm package
#   4. strict schema validation of every rendered object (scripts/helm/validate.py)
#   5. the rendered-object tests (scripts/helm/test_chart.py)
# Tools come from scripts/helm/fetch-helm.sh (cached; a failed fetch fails the check).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${TANDEM_HOME:-$HOME/.cache/tandem}/helm"
bash scripts/helm/fetch-helm.sh "$CACHE"
HELM="$CACHE/bin/helm"
PY="$CACHE/venv/bin/python"
CHART=helm/tandem
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/rendered"
mkdir "$OUT"

VALUES=(configs/helm/*.yaml "$CHART"/ci/*.yaml)
[ "${#VALUES[@]}" -ge 2 ] && [ -f "${VALUES[0]}" ] || { echo "helm check: no example values files found" >&2; exit 1; }

"$PY" -m yamllint --strict -c scripts/helm/yamllint.yaml "$CHART/Chart.yaml" "$CHART/values.yaml" "${VALUES[@]}" \
  || { echo "FAIL yamllint of the values files" >&2; exit 1; }
echo "ok   yamllint: $CHART/values.yaml and ${#VALUES[@]} example values files"

lint() {
  "$HELM" lint --strict "$CHART" "$@" > "$WORK/lint.log" 2>&1 || { cat "$WORK/lint.log" >&2; echo "FAIL helm lint --strict $*" >&2; exit 1; }
}
lint
for v in "${VALUES[@]}"; do lint -f "$v"; done
echo "ok   helm lint --strict: defaults + ${#VALUES[@]} values files"

"$HELM" template tandem "$CHART" --namespace tandem > "$OUT/default.yaml" || { echo "FAIL helm template" >&2; exit 1; }
for v in "${VALUES[@]}"; do
  name="$(basename "$(dirname "$v")")-$(basename "$v")"
  "$HELM" template tandem "$CHART" --namespace tandem -f "$v" > "$OUT/$name" || { echo "FAIL helm template -f $v" >&2; exit 1; }
done
"$PY" -m yamllint --strict -c scripts/helm/yamllint.yaml "$OUT"/*.yaml \
  || { echo "FAIL yamllint of the rendered output" >&2; exit 1; }
echo "ok   helm template + yamllint: $(ls "$OUT" | wc -l) renderings, $(cat "$OUT"/*.yaml | grep -c '^kind:') objects"

# What `helm install` adds to template: kubeVersion, NOTES.txt; and the packaged chart.
for v in "" "${VALUES[@]}"; do
  "$HELM" install tandem "$CHART" --dry-run=client --namespace tandem ${v:+-f "$v"} > "$WORK/install.log" 2>&1 \
    || { cat "$WORK/install.log" >&2; echo "FAIL helm install --dry-run=client ${v:+-f $v}" >&2; exit 1; }
  grep -q '^NOTES:' "$WORK/install.log" || { echo "FAIL helm install --dry-run=client ${v:+-f $v}: no NOTES" >&2; exit 1; }
done
"$HELM" package "$CHART" -d "$WORK" > /dev/null
tar -tzf "$WORK"/tandem-*.tgz > "$WORK/package.txt"
if grep -q '^tandem/ci/' "$WORK/package.txt"; then echo "FAIL the packaged chart contains ci/ (.helmignore)" >&2; exit 1; fi
echo "ok   helm install --dry-run=client: defaults + ${#VALUES[@]} values files; helm package"

"$PY" scripts/helm/validate.py "$CACHE/npm/node_modules" "$OUT"/*.yaml

# The router's own parser on every rendered router config (the binary `make test` builds).
TANDEM="${TANDEM_BIN:-${CARGO_TARGET_DIR:-target}/debug/tandem}"
if [ -x "$TANDEM" ]; then
  n=0
  # The Secrets' files (tls.crt, tls.key, ca.crt) the rendered TLS paths point at, stood in
  # for by generated ones: the router loads them while checking.
  "$TANDEM" tls generate --out "$WORK/certs" router > /dev/null
  mkdir "$WORK/secret"
  cp "$WORK/certs/router.crt" "$WORK/secret/tls.crt"
  cp "$WORK/certs/router.key" "$WORK/secret/tls.key"
  cp "$WORK/certs/ca.crt" "$WORK/secret/ca.crt"
  for f in "$OUT"/*.yaml; do
    "$PY" - "$f" "$WORK/router-$(basename "$f")" "$WORK/secret" <<'PYEOF' || { echo "FAIL extracting the router config of $f" >&2; exit 1; }
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "ConfigMap" and "router.yaml" in doc.get("data", {}):
        text = doc["data"]["router.yaml"]
        for mount in ("/etc/tandem-tls", "/etc/tandem-grpc", "/etc/tandem-etcd"):
            text = text.replace(mount, sys.argv[3])
        open(sys.argv[2], "w").write(text)
        break
else:
    sys.exit("no router ConfigMap")
PYEOF
    "$TANDEM" router --config "$WORK/router-$(basename "$f")" --check > "$WORK/router-check.log" 2>&1 \
      || { echo "FAIL tandem router --check on the config rendered from $f:" >&2; cat "$WORK/router-check.log" >&2; exit 1; }
    n=$((n + 1))
  done
  echo "ok   tandem router --check: $n rendered router configs"
else
  echo "skip tandem router --check: no $TANDEM (cargo build --bin tandem)"
fi

if ! HELM="$HELM" "$PY" -m unittest -v scripts/helm/test_chart.py > "$WORK/tests.log" 2>&1; then
  cat "$WORK/tests.log" >&2
  echo "FAIL scripts/helm/test_chart.py" >&2
  exit 1
fi
echo "ok   scripts/helm/test_chart.py: $(grep '^Ran ' "$WORK/tests.log")"
echo "helm check passed"
