"""Tests of the rendered Helm chart (scripts/helm/check.sh runs them; no cluster needed).

Each values set the project ships (defaults, configs/helm/*.yaml, helm/tandem/ci/*.yaml) is
rendered with `helm template` and checked against what a working tandem release needs:
probes on endpoints that mean liveness/readiness/startup, grace periods that outlast the
workers' drain deadline, one workload per role, autoscalers aimed at the right Deployment,
workers that register in etcd with a reachable address, a router config the router accepts,
pinned images, GPU requests where the layout needs GPUs. `CheckerCatchesMistakes` feeds the
same checks broken renderings, so each check is known to be able to fail; `RenderRefuses`
shows the chart's own `fail`s stop bad values.

env: HELM (the helm binary). Run: python -m unittest scripts/helm/test_chart.py
"""

import copy
import json
import os
import re
import subprocess
import unittest

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "helm", "tandem")
HELM = os.environ.get("HELM", "helm")
RELEASE = "t"
VALUE_SETS = {
    "default": [],
    "cpu": [os.path.join(ROOT, "configs", "helm", "cpu.yaml")],
    "gpu-8x": [os.path.join(ROOT, "configs", "helm", "gpu-8x.yaml")],
    "ci-keda": [os.path.join(CHART, "ci", "keda-values.yaml")],
    "ci-hpa": [os.path.join(CHART, "ci", "hpa-values.yaml")],
    "ci-tls": [os.path.join(CHART, "ci", "tls-values.yaml")],
}
# crates/router/src/config/: RawConfig and its sections (deny_unknown_fields).
ROUTER_CONFIG_KEYS = {"listen", "model", "prefill", "decode", "aggregated", "policy", "timeouts", "discovery", "auth", "tls", "worker_tls"}
ROUTER_SECTION_KEYS = {
    "tls": {"cert", "key", "client_ca"},
    "worker_tls": {"ca", "cert", "key", "server_name"},
    "model": {"served_name", "dir"},
    "timeouts": {"connect", "first_token", "inter_token", "request"},
    "policy": {"kind"},
    "discovery": {"etcd"},
    "auth": {"api_keys", "api_keys_file", "api_keys_env", "protect_health", "protect_metrics"},
}
POOL_ROLES = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}
# Margin the chart requires past the drain deadline (deregistration and exit).
GRACE_MARGIN_S = 5


def render(*value_files, sets=()):
    """Rendered objects of the chart, or raises with helm's message."""
    cmd = [HELM, "template", RELEASE, CHART, "--namespace", "ns"]
    for f in value_files:
        cmd += ["-f", f]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RenderError(out.stderr.strip())
    return [d for d in yaml.safe_load_all(out.stdout) if d]


class RenderError(Exception):
    pass


def chart_app_version():
    with open(os.path.join(CHART, "Chart.yaml"), encoding="utf-8") as f:
        return str(yaml.safe_load(f)["appVersion"])


def seconds(text):
    """A humantime duration as the workers' flags take it (`30s`, `2m`, `1m30s`)."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, f"not a duration: {text!r}"
    h, m, s = (int(p or 0) for p in parts.groups())
    return h * 3600 + m * 60 + s


def flags(args):
    """`--name=value` / `--name value` arguments as a dict (the last one wins)."""
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a[2:].split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                k, v = a[2:], args[i + 1]
                i += 1
            else:
                k, v = a[2:], True
            out[k] = v
        i += 1
    return out


def component(obj):
    return obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def container(obj, name):
    found = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{obj['metadata']['name']}: expected one container {name!r}"
    return found[0]


def named_port(c, name):
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert name in ports, f"container {c['name']}: no port named {name!r} ({sorted(ports)})"
    return ports[name]


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def probe_handler(probe):
    kinds = [k for k in ("httpGet", "tcpSocket", "grpc", "exec") if k in probe]
    assert len(kinds) == 1, f"probe with handlers {kinds}"
    return kinds[0], probe[kinds[0]]


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_release(docs, where=""):
    """Asserts everything a working release needs; returns a summary of what it saw."""
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"{where}: objects rendered twice: {dupes}"
    deployments = by_kind.get("Deployment", [])
    statefulsets = by_kind.get("StatefulSet", [])
    workloads = deployments + statefulsets

    # One workload per role.
    roles = [component(d) for d in workloads]
    for role in set(roles):
        assert roles.count(role) == 1, f"{where}: {roles.count(role)} workloads for {role}"
    assert "router" in roles, f"{where}: no router Deployment"
    pools = [r for r in roles if r in POOL_ROLES]
    assert pools, f"{where}: no worker pool"
    assert ("prefill" in pools) == ("decode" in pools), f"{where}: prefill and decode come together ({pools})"
    workload = {component(d): d for d in workloads}

    # Router: its config, probes and ports.
    router = workload["router"]
    rc = container(router, "router")
    rflags = flags(rc["args"])
    assert rc["args"][0] == "router", f"{where}: router container runs {rc['args'][0]!r}"
    cm_volume = [v for v in pod_spec(router)["volumes"] if "configMap" in v]
    assert len(cm_volume) == 1, f"{where}: router mounts {len(cm_volume)} ConfigMaps"
    cm_name = cm_volume[0]["configMap"]["name"]
    cms = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"] == cm_name]
    assert cms, f"{where}: router mounts ConfigMap {cm_name}, which is not rendered"
    mount = [m for m in rc["volumeMounts"] if m["name"] == cm_volume[0]["name"]][0]
    config_file = rflags["config"]
    assert os.path.dirname(config_file) == mount["mountPath"], f"{where}: --config {config_file} is not in the ConfigMap mount"
    config = yaml.safe_load(cms[0]["data"][os.path.basename(config_file)])
    assert isinstance(config, dict), f"{where}: router config is not a mapping"
    assert set(config) <= ROUTER_CONFIG_KEYS, f"{where}: router config has unknown keys {set(config) - ROUTER_CONFIG_KEYS}"
    for section, allowed in ROUTER_SECTION_KEYS.items():
        extra = set(config.get(section) or {}) - allowed
        assert not extra, f"{where}: router config {section} has unknown keys {extra}"
    etcd = config["discovery"]["etcd"]
    assert set(etcd) <= {"endpoints", "prefix", "tls"}, f"{where}: discovery.etcd keys {set(etcd)}"
    assert set(etcd.get("tls") or {}) <= {"ca", "cert", "key"}, f"{where}: discovery.etcd.tls keys {set(etcd['tls'])}"
    endpoints = etcd["endpoints"]
    assert isinstance(endpoints, list) and endpoints, f"{where}: discovery.etcd.endpoints must be a non-empty list"
    assert all(re.fullmatch(r"https?://[^/\s]+(:\d+)?/?", e) for e in endpoints), f"{where}: bad etcd endpoints {endpoints}"
    etcd_scheme = "https://" if etcd.get("tls") else "http://"
    assert all(e.startswith(etcd_scheme) for e in endpoints), f"{where}: etcd endpoints {endpoints} with tls {etcd.get('tls')}"
    prefix = etcd.get("prefix", "/tandem")
    assert prefix.startswith("/"), f"{where}: discovery prefix {prefix!r}"
    for name, value in (config.get("timeouts") or {}).items():
        seconds(value)
    assert config["model"]["served_name"], f"{where}: empty served_name"
    listen_port = int(config["listen"].rsplit(":", 1)[1])
    assert config["listen"].startswith("0.0.0.0:"), f"{where}: router listens on {config['listen']} (not reachable from the Service)"
    assert named_port(rc, "http") == listen_port, f"{where}: router port http != config listen port {listen_port}"
    model_dir = rflags.get("model") or config["model"].get("dir")
    assert model_dir, f"{where}: the router has no model directory (tokenizer)"
    probes = {k: rc.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert all(probes.values()), f"{where}: router probes missing: {[k for k, v in probes.items() if not v]}"
    front_tls = config.get("tls") or {}
    for kind, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        handler, spec = probe_handler(probes[kind])
        if front_tls.get("client_ca"):
            # Clients need certificates the kubelet does not have: the probes only connect.
            assert handler == "tcpSocket", f"{where}: router {kind} is {handler} but clients need certificates"
            continue
        assert handler == "httpGet" and spec["path"] == path, f"{where}: router {kind} is {handler} {spec}, want GET {path}"
        want_scheme = "HTTPS" if front_tls else "HTTP"
        assert spec.get("scheme", "HTTP") == want_scheme, f"{where}: router {kind} scheme {spec.get('scheme')}, want {want_scheme}"
        assert spec["port"] in ("http", listen_port), f"{where}: router {kind} probes port {spec['port']}"
    sleep = rc.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod_spec(router).get("terminationGracePeriodSeconds", 30) > sleep, f"{where}: router grace period <= its preStop sleep"

    # etcd: the endpoints the router uses and the workers' --discovery name the same hosts.
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    etcd_hosts = [re.sub(r"^https?://", "", e).rstrip("/") for e in endpoints]
    if "etcd" in workload:
        host, port = etcd_hosts[0].rsplit(":", 1)
        svc = services.get(host.split(".")[0])
        assert svc, f"{where}: bundled etcd endpoint {host} names no rendered Service"
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]], f"{where}: etcd Service has no port {port}"
        assert matches(svc["spec"]["selector"], workload["etcd"]["spec"]["template"]["metadata"]["labels"]), f"{where}: etcd Service selects no etcd pod"
        ec = container(workload["etcd"], "etcd")
        assert all(ec.get(k) for k in ("livenessProbe", "readinessProbe")), f"{where}: etcd probes missing"

    # Workers.
    for pool in pools:
        w = workload[pool]
        wc = container(w, "worker")
        assert wc["args"][0] == "worker", f"{where}: {pool} container runs {wc['args'][0]!r}"
        f = flags(wc["args"][1:])
        assert f.get("role") == POOL_ROLES[pool], f"{where}: {pool} runs --role {f.get('role')}"
        grpc = named_port(wc, "grpc")
        assert f.get("listen") == f"0.0.0.0:{grpc}", f"{where}: {pool} --listen {f.get('listen')} vs port grpc {grpc}"
        scheme = "https" if config.get("worker_tls") else "http"
        assert f.get("advertise") == f"{scheme}://$(POD_IP):{grpc}", f"{where}: {pool} --advertise {f.get('advertise')}"
        assert f.get("worker-id") == "$(POD_NAME)", f"{where}: {pool} --worker-id {f.get('worker-id')}"
        env = env_of(wc)
        assert env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP", f"{where}: {pool} POD_IP is not the downward-API pod IP"
        assert env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name", f"{where}: {pool} POD_NAME is not the pod name"
        disc = f.get("discovery") or env.get("TANDEM_DISCOVERY", {}).get("value")
        assert disc and disc.startswith("etcd://"), f"{where}: {pool} has no --discovery etcd://..."
        worker_hosts = [re.sub(r"^https?://", "", h) for h in disc[len("etcd://"):].split(",")]
        assert worker_hosts == etcd_hosts, f"{where}: {pool} registers in {worker_hosts}, the router watches {etcd_hosts}"
        assert f.get("discovery-prefix", "/tandem") == prefix, f"{where}: {pool} prefix {f.get('discovery-prefix')} != router {prefix}"
        assert f.get("model") == model_dir, f"{where}: {pool} serves {f.get('model')}, the router tokenizes for {model_dir}"
        ucx = env.get("UCX_NET_DEVICES", {}).get("value")
        assert ucx and ucx != "lo", f"{where}: {pool} UCX_NET_DEVICES={ucx!r}: KV transfers would stay on loopback"
        if pool == "decode":
            kv = named_port(wc, "kv")
            assert f.get("transfer-listen") == f"$(POD_IP):{kv}", f"{where}: decode --transfer-listen {f.get('transfer-listen')} (must be the pod IP and port kv {kv})"
        deadline = seconds(f.get("drain-deadline", "30s"))
        grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
        assert grace >= deadline + GRACE_MARGIN_S, f"{where}: {pool} terminationGracePeriodSeconds {grace} < drain deadline {deadline}s + {GRACE_MARGIN_S}s"
        pre = wc.get("lifecycle", {}).get("preStop")
        if pre:
            cmd = pre["exec"]["command"]
            assert cmd[1:3] == ["admin", "drain"], f"{where}: {pool} preStop runs {cmd}"
            pf = flags(cmd[3:])
            assert pf["worker"].endswith(f":{grpc}"), f"{where}: {pool} preStop drains {pf['worker']}"
            assert seconds(pf.get("deadline", f"{deadline}s")) <= deadline, f"{where}: {pool} preStop deadline exceeds --drain-deadline"
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = wc.get(kind)
            assert probe, f"{where}: {pool} has no {kind}"
            handler, spec = probe_handler(probe)
            assert handler == "tcpSocket" and spec["port"] in ("grpc", grpc), f"{where}: {pool} {kind} is {handler} {spec}, want tcpSocket on grpc"
        startup = wc["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert budget >= 300, f"{where}: {pool} startupProbe allows {budget}s for the model load"
        if f.get("device", "cpu").startswith("cuda"):
            gpus = wc.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
            assert int(gpus) >= 1, f"{where}: {pool} runs on {f['device']} without an nvidia.com/gpu limit"

    # Every tandem container runs the same pinned image.
    images = {c["image"] for d in workloads for c in pod_spec(d)["containers"] + pod_spec(d).get("initContainers", [])}
    for image in images:
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest", f"{where}: image {image} has no pinned tag"
    tandem_images = {c["image"] for d in workloads if component(d) != "etcd" for c in pod_spec(d)["containers"]}
    assert len(tandem_images) == 1, f"{where}: tandem containers run different images {tandem_images}"

    # Mounts name declared volumes; Services and PDBs select pods that exist.
    for d in workloads:
        declared = {v["name"] for v in pod_spec(d).get("volumes", [])}
        declared |= {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
        for c in pod_spec(d)["containers"] + pod_spec(d).get("initContainers", []):
            for m in c.get("volumeMounts", []):
                assert m["name"] in declared, f"{where}: {d['metadata']['name']}/{c['name']} mounts undeclared volume {m['name']}"
        assert matches(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]), f"{where}: {d['metadata']['name']} selector does not match its pods"
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in workloads]
    for svc in services.values():
        sel = svc["spec"]["selector"]
        targets = [d for d in workloads if matches(sel, d["spec"]["template"]["metadata"]["labels"])]
        assert targets, f"{where}: Service {svc['metadata']['name']} selects no pods"
        ports = {p["name"] for d in targets for c in pod_spec(d)["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{where}: Service {svc['metadata']['name']} targets missing port {p['targetPort']}"
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(sel, lbl) for lbl in pod_labels), f"{where}: PDB {pdb['metadata']['name']} selects no pods"

    # Autoscalers: one per Deployment at most, aimed at a rendered Deployment, on its role.
    scalers = by_kind.get("HorizontalPodAutoscaler", []) + by_kind.get("ScaledObject", [])
    targeted = [s["spec"]["scaleTargetRef"]["name"] for s in scalers]
    assert len(targeted) == len(set(targeted)), f"{where}: a Deployment has two autoscalers: {targeted}"
    deployment_by_name = {d["metadata"]["name"]: d for d in deployments}
    for s in scalers:
        ref = s["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment", f"{where}: {s['kind']} {s['metadata']['name']} targets a {ref.get('kind')}"
        target = deployment_by_name.get(ref["name"])
        assert target, f"{where}: {s['kind']} {s['metadata']['name']} targets {ref['name']}, which is not rendered"
        assert "replicas" not in target["spec"], f"{where}: {ref['name']} sets replicas under an autoscaler (helm upgrade would reset it)"
        pool = component(target)
        if pool in POOL_ROLES:
            role = POOL_ROLES[pool]
            if s["kind"] == "HorizontalPodAutoscaler":
                for m in s["spec"]["metrics"]:
                    sel = m["external"]["metric"]["selector"]["matchLabels"]
                    assert sel.get("role") == role, f"{where}: HPA of {pool} scales on role {sel.get('role')}"
            else:
                for t in s["spec"]["triggers"]:
                    q = t["metadata"]["query"]
                    assert f'role="{role}"' in q, f"{where}: ScaledObject of {pool} queries {q}"
        lo = s["spec"].get("minReplicas", s["spec"].get("minReplicaCount"))
        hi = s["spec"].get("maxReplicas", s["spec"].get("maxReplicaCount"))
        assert lo <= hi, f"{where}: {s['metadata']['name']} min {lo} > max {hi}"
    return {"roles": sorted(roles), "scalers": sorted(targeted), "images": sorted(images)}


def by(docs, kind, comp):
    found = [d for d in docs if d["kind"] == kind and component(d) == comp]
    assert len(found) == 1, f"{len(found)} {kind} for {comp}"
    return found[0]


class Examples(unittest.TestCase):
    """Every shipped values set renders into a release that passes check_release."""

    def test_every_values_set(self):
        for name, files in VALUE_SETS.items():
            with self.subTest(values=name):
                check_release(render(*files), name)

    def test_api_keys_come_from_a_mounted_secret(self):
        docs = render(sets=["router.apiKeys.secretName=tandem-keys", "router.apiKeys.secretKey=keys"])
        cm = by(docs, "ConfigMap", "router")
        cfg = yaml.safe_load(cm["data"]["router.yaml"])
        self.assertEqual(cfg["auth"]["api_keys_file"], "/etc/tandem-keys/keys")
        self.assertFalse(cfg["auth"]["protect_health"], "probes must stay open")
        d = by(docs, "Deployment", "router")
        vols = {v["name"]: v for v in pod_spec(d)["volumes"]}
        self.assertEqual(vols["api-keys"]["secret"]["secretName"], "tandem-keys")
        mounts = {m["name"]: m["mountPath"] for m in container(d, "router")["volumeMounts"]}
        self.assertEqual(mounts["api-keys"], "/etc/tandem-keys")
        # Without a Secret: no auth section, no volume.
        docs = render()
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        self.assertNotIn("auth", cfg)
        self.assertNotIn("api-keys", {v["name"] for v in pod_spec(by(docs, "Deployment", "router"))["volumes"]})

    def test_tls_mounts_its_secrets_and_turns_https_and_mutual_tls_on(self):
        docs = render(sets=["tls.https.secretName=front", "tls.grpc.enabled=true",
                            "tls.grpc.routerSecretName=router-grpc", "tls.grpc.workerSecretName=worker-grpc"])
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        self.assertEqual(cfg["tls"], {"cert": "/etc/tandem-tls/tls.crt", "key": "/etc/tandem-tls/tls.key"})
        self.assertEqual(cfg["worker_tls"]["ca"], "/etc/tandem-grpc/ca.crt")
        self.assertEqual(cfg["worker_tls"]["server_name"], "tandem-worker")
        d = by(docs, "Deployment", "router")
        vols = {v["name"]: v for v in pod_spec(d)["volumes"]}
        self.assertEqual(vols["https-tls"]["secret"]["secretName"], "front")
        self.assertEqual(vols["grpc-tls"]["secret"]["secretName"], "router-grpc")
        r = container(d, "router")
        kind, handler = probe_handler(r["readinessProbe"])
        self.assertEqual((kind, handler.get("scheme")), ("httpGet", "HTTPS"))
        for pool in ("prefill", "decode"):
            w = by(docs, "Deployment", pool)
            args = container(w, "worker")["args"]
            self.assertIn("--tls-client-ca=/etc/tandem-grpc/ca.crt", args)
            self.assertTrue(any(a.startswith("--advertise=https://") for a in args), args)
            self.assertEqual({v["name"]: v for v in pod_spec(w)["volumes"]}["grpc-tls"]["secret"]["secretName"],
                             "worker-grpc")
            self.assertNotIn("lifecycle", container(w, "worker"), "no plain-text preStop drain")
        # Client certificates on the front: the kubelet has none, so the probes only connect.
        docs = render(sets=["tls.https.secretName=front", "tls.https.requireClientCert=true"])
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        self.assertEqual(cfg["tls"]["client_ca"], "/etc/tandem-tls/ca.crt")
        kind, _ = probe_handler(container(by(docs, "Deployment", "router"), "router")["livenessProbe"])
        self.assertEqual(kind, "tcpSocket")
        # Off by default.
        docs = render()
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        self.assertFalse({"tls", "worker_tls"} & set(cfg))
        args = container(by(docs, "Deployment", "decode"), "worker")["args"]
        self.assertFalse(any(a.startswith("--tls") for a in args), args)

    def test_etcd_tls_mounts_the_client_secret_everywhere_and_the_bundled_etcd_requires_certificates(self):
        docs = render(sets=["tls.etcd.enabled=true", "tls.etcd.clientSecretName=etcd-client",
                            "tls.etcd.serverSecretName=etcd-server"])
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        etcd = cfg["discovery"]["etcd"]
        self.assertEqual(etcd["tls"], {"ca": "/etc/tandem-etcd/ca.crt", "cert": "/etc/tandem-etcd/tls.crt",
                                       "key": "/etc/tandem-etcd/tls.key"})
        self.assertTrue(all(e.startswith("https://") for e in etcd["endpoints"]), etcd)
        for kind, name, c in (("Deployment", "router", "router"), ("Deployment", "prefill", "worker"),
                              ("Deployment", "decode", "worker")):
            d = by(docs, kind, name)
            self.assertEqual({v["name"]: v for v in pod_spec(d)["volumes"]}["etcd-tls"]["secret"]["secretName"],
                             "etcd-client", name)
            mounts = {m["name"]: m["mountPath"] for m in container(d, c)["volumeMounts"]}
            self.assertEqual(mounts["etcd-tls"], "/etc/tandem-etcd", name)
        for pool in ("prefill", "decode"):
            f = flags(container(by(docs, "Deployment", pool), "worker")["args"][1:])
            self.assertEqual((f["etcd-ca"], f["etcd-cert"], f["etcd-key"]),
                             ("/etc/tandem-etcd/ca.crt", "/etc/tandem-etcd/tls.crt", "/etc/tandem-etcd/tls.key"))
            self.assertTrue(f["discovery"].startswith("etcd://https://"), f["discovery"])
        e = by(docs, "StatefulSet", "etcd")
        ec = container(e, "etcd")
        args = ec["args"]
        for flag in ("--client-cert-auth", "--trusted-ca-file=/etc/etcd-tls/ca.crt", "--cert-file=/etc/etcd-tls/tls.crt"):
            self.assertIn(flag, args)
        self.assertTrue(any(a.startswith("--listen-client-urls=https://") for a in args), args)
        self.assertEqual({v["name"]: v for v in pod_spec(e)["volumes"]}["etcd-tls"]["secret"]["secretName"],
                         "etcd-server")
        # The kubelet has no client certificate: the probes use the plain metrics port.
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            kind, spec = probe_handler(ec[probe])
            self.assertEqual((kind, spec["port"], spec.get("scheme", "HTTP")), ("httpGet", "metrics", "HTTP"), probe)
        self.assertIn("metrics", [p["name"] for p in ec["ports"]])
        # Off by default: plain etcd, no etcd flags or volumes.
        docs = render()
        cfg = yaml.safe_load(by(docs, "ConfigMap", "router")["data"]["router.yaml"])
        self.assertNotIn("tls", cfg["discovery"]["etcd"])
        args = container(by(docs, "Deployment", "decode"), "worker")["args"]
        self.assertFalse(any(a.startswith("--etcd") for a in args), args)
        self.assertNotIn("--client-cert-auth", container(by(docs, "StatefulSet", "etcd"), "etcd")["args"])

    def test_default_image_is_the_app_version(self):
        docs = render()
        image = container(by(docs, "Deployment", "router"), "router")["image"]
        self.assertEqual(image.rsplit(":", 1)[1], chart_app_version())
        self.assertNotEqual(chart_app_version(), "latest")

    def test_cpu_example(self):
        docs = render(*VALUE_SETS["cpu"])
        self.assertEqual(by(docs, "Deployment", "prefill")["spec"]["replicas"], 1)
        self.assertEqual(by(docs, "Deployment", "decode")["spec"]["replicas"], 1)
        self.assertFalse([d for d in docs if component(d) == "aggregated"])
        etcd = by(docs, "StatefulSet", "etcd")
        self.assertRegex(container(etcd, "etcd")["image"], r"^quay\.io/coreos/etcd:v3\.5\.\d+$")
        for pool in ("prefill", "decode"):
            d = by(docs, "Deployment", pool)
            f = flags(container(d, "worker")["args"][1:])
            self.assertEqual((f["device"], f["dtype"]), ("cpu", "f32"))
            self.assertTrue(f["model"].endswith("/smollm2-135m-instruct"))
            self.assertNotIn("nvidia.com/gpu", str(container(d, "worker").get("resources")))
            init = pod_spec(d)["initContainers"][0]
            self.assertEqual(init["args"], ["model", "pull", "smollm2-135m-instruct"])

    def test_gpu_example(self):
        docs = render(*VALUE_SETS["gpu-8x"])
        layouts = {"prefill": ("8", "1", "8"), "decode": ("8", "8", "8")}
        for pool, (tp, dp, ep) in layouts.items():
            d = by(docs, "Deployment", pool)
            c = container(d, "worker")
            f = flags(c["args"][1:])
            self.assertEqual((f["tp"], f["dp"], f["ep"]), (tp, dp, ep), pool)
            self.assertEqual((f["device"], f["dtype"]), ("cuda:0", "bf16"), pool)
            self.assertEqual(c["resources"]["requests"]["nvidia.com/gpu"], 8, pool)
            self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 8, pool)
            self.assertIn("nvidia.com/gpu", [t.get("key") for t in pod_spec(d)["tolerations"]], pool)
            self.assertEqual(by(docs, "HorizontalPodAutoscaler", pool)["spec"]["scaleTargetRef"]["name"], d["metadata"]["name"])
        self.assertFalse([d for d in docs if d["kind"] == "StatefulSet"], "gpu-8x uses an external etcd")
        router = container(by(docs, "Deployment", "router"), "router")
        self.assertNotIn("nvidia.com/gpu", str(router.get("resources")))

    def test_keda_replaces_hpas(self):
        docs = render(*VALUE_SETS["ci-keda"])
        kinds = {(d["kind"], component(d)) for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")}
        self.assertEqual(kinds, {("ScaledObject", "prefill"), ("ScaledObject", "decode"),
                                 ("ScaledObject", "aggregated"), ("HorizontalPodAutoscaler", "router")})
        self.assertTrue([d for d in docs if d["kind"] == "ServiceMonitor"])

    def test_external_etcd_urls(self):
        docs = render(*VALUE_SETS["ci-hpa"])
        f = flags(container(by(docs, "Deployment", "aggregated"), "worker")["args"][1:])
        self.assertEqual(f["discovery"], "etcd://https://etcd.infra.svc:2379,https://etcd-b.infra.svc:2379")
        self.assertEqual(f["etcd-cert"], "/etc/tandem-etcd/tls.crt")
        self.assertEqual(pod_spec(by(docs, "Deployment", "aggregated"))["terminationGracePeriodSeconds"], 90)


class ValuesDocumented(unittest.TestCase):
    """Every key of values.yaml has a comment (above it or on its line), except the insides
    of Kubernetes-native blocks documented as a whole (resources, strategy, env, ...)."""

    FREE_FORM = {"resources", "strategy", "env", "behavior", "volume", "startup", "liveness", "readiness"}

    def undocumented(self, text):
        lines, stack, missing = text.splitlines(), [], []
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)(?:- )?([A-Za-z_][\w.-]*):", line)
            if not m or line.lstrip().startswith("#"):
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = [k for _, k in stack] + [m.group(2)]
            stack.append((indent, m.group(2)))
            if set(path[:-1]) & self.FREE_FORM:
                continue
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            if not ((j >= 0 and lines[j].lstrip().startswith("#")) or " #" in line):
                missing.append(".".join(path))
        return missing

    def test_every_key_has_a_comment(self):
        with open(os.path.join(CHART, "values.yaml"), encoding="utf-8") as f:
            self.assertEqual(self.undocumented(f.read()), [])

    def test_the_check_can_fail(self):
        self.assertEqual(self.undocumented("# -- a\na: 1\nb:\n  # -- c\n  c: 2\n"), ["b"])


class Overrides(unittest.TestCase):
    """A pool's own keys win over `workers`, key by key, and touch no other pool."""

    def test_pool_layout_merges_key_by_key(self):
        docs = render(sets=["prefill.layout.tp=4"])
        p = flags(container(by(docs, "Deployment", "prefill"), "worker")["args"][1:])
        d = flags(container(by(docs, "Deployment", "decode"), "worker")["args"][1:])
        self.assertEqual((p["tp"], p["dp"], p["ep"]), ("4", "1", "1"))
        self.assertEqual(d["tp"], "1")

    def test_pool_false_beats_default_true(self):
        docs = render(sets=["prefill.pdb.enabled=false"])
        pdbs = {component(d) for d in docs if d["kind"] == "PodDisruptionBudget"}
        self.assertEqual(pdbs, {"router", "decode"})

    def test_prefix_cache_turns_off_per_pool(self):
        docs = render(sets=["prefill.prefixCache=false"])
        args = lambda comp: container(by(docs, "Deployment", comp), "worker")["args"]
        self.assertIn("--no-prefix-cache", args("prefill"))
        self.assertNotIn("--no-prefix-cache", args("decode"))
        self.assertNotIn("--no-prefix-cache", str(render()))

    def test_grace_follows_the_drain_deadline(self):
        docs = render(sets=["decode.drainDeadlineSeconds=300"])
        d = by(docs, "Deployment", "decode")
        self.assertEqual(flags(container(d, "worker")["args"][1:])["drain-deadline"], "300s")
        self.assertEqual(pod_spec(d)["terminationGracePeriodSeconds"], 315)
        check_release(docs, "long drain")

    def test_autoscaled_pool_leaves_replicas_to_the_hpa(self):
        docs = render(sets=["decode.autoscaling.enabled=true"])
        self.assertNotIn("replicas", by(docs, "Deployment", "decode")["spec"])
        self.assertIn("replicas", by(docs, "Deployment", "prefill")["spec"])
        hpa = by(docs, "HorizontalPodAutoscaler", "decode")
        self.assertEqual(hpa["spec"]["metrics"][0]["external"]["metric"]["name"], "tandem_pool_in_flight")
        check_release(docs, "decode hpa")


DASHBOARD = os.path.join(CHART, "dashboards", "tandem.json")
# PromQL words in the dashboard's queries that are not metric names.
PROMQL_WORDS = {"sum", "max", "rate", "histogram_quantile", "label_values"}


def dashboard_metrics(dashboard):
    """The metric names the dashboard's queries (panels and template variables) read."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    names = set()
    for e in exprs:
        # Selectors, ranges, strings, groupings and label_values' label are no metric names.
        e = re.sub(r'\{[^}]*\}|\[[^]]*\]|"[^"]*"|\bby\s*\([^)]*\)|,\s*\w+\s*\)', "", e)
        names.update(w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if w not in PROMQL_WORDS
                     and not w.startswith("$"))
    return names


class GrafanaDashboard(unittest.TestCase):
    """The chart ships dashboards/tandem.json unchanged in a ConfigMap Grafana's sidecar picks
    up. That every name its queries read is one the processes export is checked against a
    real scrape by the end-to-end test tests/tests/metrics.rs, which reads the same file."""

    def dashboard_configmap(self, docs):
        maps = [d for d in docs if d["kind"] == "ConfigMap" and component(d) == "dashboard"]
        self.assertEqual(len(maps), 1)
        return maps[0]

    def test_the_configmap_carries_the_file_and_the_sidecar_label(self):
        for name, files in VALUE_SETS.items():
            cm = self.dashboard_configmap(render(*files))
            self.assertEqual(cm["metadata"]["labels"]["grafana_dashboard"], "1", name)
            with open(DASHBOARD) as f:
                self.assertEqual(json.loads(cm["data"]["tandem.json"]), json.load(f), name)

    def test_label_namespace_and_switch_are_values(self):
        cm = self.dashboard_configmap(render(sets=["grafanaDashboard.sidecarLabel=dashboards",
                                                   "grafanaDashboard.sidecarLabelValue=tandem",
                                                   "grafanaDashboard.namespace=monitoring"]))
        self.assertEqual(cm["metadata"]["labels"]["dashboards"], "tandem")
        self.assertNotIn("grafana_dashboard", cm["metadata"]["labels"])
        self.assertEqual(cm["metadata"]["namespace"], "monitoring")
        docs = render(sets=["grafanaDashboard.enabled=false"])
        self.assertFalse([d for d in docs if component(d) == "dashboard"])

    def test_queries_read_vllm_and_tandem_families(self):
        with open(DASHBOARD) as f:
            names = dashboard_metrics(json.load(f))
        self.assertIn("vllm:time_to_first_token_seconds_bucket", names)
        self.assertIn("tandem_handoff_failures_total", names)
        self.assertIn("vllm:num_requests_running", names, "the model_name variable's query")
        stray = {n for n in names if not n.startswith(("vllm:", "tandem_"))}
        self.assertFalse(stray, "names the extraction should have dropped")


class RenderRefuses(unittest.TestCase):
    """Values that cannot work stop `helm template` with a message saying why."""

    def refused(self, *sets, says):
        with self.assertRaises(RenderError) as caught:
            render(sets=sets)
        self.assertIn(says, str(caught.exception))

    def test_mutual_tls_needs_both_secrets(self):
        self.refused("tls.grpc.enabled=true", "tls.grpc.routerSecretName=r", says="tls.grpc.workerSecretName")

    def test_etcd_tls_needs_its_secrets_and_https_endpoints(self):
        self.refused("tls.etcd.enabled=true", says="tls.etcd.clientSecretName")
        self.refused("tls.etcd.enabled=true", "tls.etcd.clientSecretName=c", says="tls.etcd.serverSecretName")
        external = ("etcd.bundled.enabled=false", "tls.etcd.enabled=true", "tls.etcd.clientSecretName=c")
        self.refused(*external, "etcd.endpoints[0]=http://e:2379", says="must be https://")
        self.refused("etcd.bundled.enabled=false", "etcd.endpoints[0]=https://e:2379", says="set tls.etcd.enabled")

    def test_grace_shorter_than_drain_deadline(self):
        self.refused("decode.terminationGracePeriodSeconds=20", says="must be at least the drain deadline")
        self.refused("workers.drainMarginSeconds=0", says="must be at least the drain deadline")

    def test_latest_tag(self):
        self.refused("image.tag=latest", says="latest")

    def test_etcd_neither_or_both(self):
        self.refused("etcd.bundled.enabled=false", says="set etcd.endpoints")
        self.refused("etcd.endpoints[0]=http://e:2379", says="not both")
        self.refused("etcd.bundled.enabled=false", "etcd.endpoints[0]=e:2379", says="e:2379")

    def test_prefill_without_decode(self):
        self.refused("decode.enabled=false", says="go together")
        self.refused("decode.enabled=false", "prefill.enabled=false", says="no worker pool")

    def test_cuda_without_gpus(self):
        self.refused("workers.device=cuda:0", says="needs gpus")

    def test_keda_needs_prometheus(self):
        self.refused("keda.enabled=true", "prefill.autoscaling.enabled=true", "keda.prometheus.serverAddress=",
                     says="serverAddress")

    def test_values_schema(self):
        # values.schema.json: a misspelt key or a bad enum is an error, not a silent default.
        self.refused("prefil.replicas=2", says="'prefil' not allowed")
        self.refused("decode.layuot.tp=8", says="'layuot' not allowed")
        self.refused("workers.dtype=fp16", says="/workers/dtype")
        self.refused("prefill.layout.tp=0", says="/prefill/layout/tp")

    def test_router_hpa_needs_cpu_request(self):
        self.refused("router.autoscaling.enabled=true", "router.resources.requests=null", says="requests.cpu")


class CheckerCatchesMistakes(unittest.TestCase):
    """check_release fails on renderings with the mistakes it exists to catch."""

    @classmethod
    def setUpClass(cls):
        cls.good = render(*VALUE_SETS["ci-keda"])
        check_release(cls.good, "baseline")

    def broken(self, mutate, says):
        docs = copy.deepcopy(self.good)
        mutate(docs)
        with self.assertRaises(AssertionError) as caught:
            check_release(docs, "mutated")
        self.assertIn(says, str(caught.exception))

    def worker(self, docs, pool="decode"):
        return container(by(docs, "Deployment", pool), "worker")

    def test_short_grace(self):
        self.broken(lambda d: pod_spec(by(d, "Deployment", "decode")).update(terminationGracePeriodSeconds=30),
                    "terminationGracePeriodSeconds 30 < drain deadline 60s")

    def test_missing_or_wrong_probes(self):
        self.broken(lambda d: container(by(d, "Deployment", "router"), "router").pop("readinessProbe"), "router probes missing")
        self.broken(lambda d: container(by(d, "Deployment", "router"), "router")["readinessProbe"]["httpGet"].update(path="/health"),
                    "want GET /ready")
        self.broken(lambda d: self.worker(d, "prefill").pop("startupProbe"), "prefill has no startupProbe")
        self.broken(lambda d: self.worker(d).update(livenessProbe={"httpGet": {"path": "/", "port": 50061}}), "want tcpSocket")

    def test_worker_args(self):
        def drop(flag):
            return lambda d: self.worker(d)["args"].__setitem__(
                slice(None), [a for a in self.worker(d)["args"] if not a.startswith(flag)])
        self.broken(drop("--advertise"), "--advertise None")
        self.broken(drop("--discovery="), "no --discovery")
        self.broken(drop("--transfer-listen"), "--transfer-listen None")

    def test_two_workloads_for_a_role(self):
        def dup(d):
            extra = copy.deepcopy(by(d, "Deployment", "prefill"))
            extra["metadata"]["name"] += "-2"
            d.append(extra)
        self.broken(dup, "2 workloads for prefill")

    def test_autoscaler_aimed_elsewhere(self):
        self.broken(lambda d: by(d, "ScaledObject", "decode")["spec"]["scaleTargetRef"].update(name="t-tandem-prefill"),
                    "two autoscalers")
        self.broken(lambda d: by(d, "ScaledObject", "decode")["spec"]["scaleTargetRef"].update(name="nope"), "not rendered")

    def test_router_config(self):
        def edit(fn):
            def mutate(d):
                cm = by(d, "ConfigMap", "router")
                cfg = yaml.safe_load(cm["data"]["router.yaml"])
                fn(cfg)
                cm["data"]["router.yaml"] = yaml.safe_dump(cfg)
            return mutate
        self.broken(edit(lambda c: c["discovery"]["etcd"].update(endpoints="http://e:2379")), "non-empty list")
        self.broken(edit(lambda c: c.update(workers=[])), "unknown keys")
        self.broken(edit(lambda c: c.update(listen="127.0.0.1:8000")), "not reachable")

    def test_latest_image(self):
        def latest(d):
            for doc in d:
                if doc["kind"] == "Deployment":
                    for c in pod_spec(doc)["containers"]:
                        c["image"] = c["image"].rsplit(":", 1)[0] + ":latest"
        self.broken(latest, "no pinned tag")

    def test_loopback_ucx(self):
        def lo(d):
            for e in self.worker(d)["env"]:
                if e["name"] == "UCX_NET_DEVICES":
                    e["value"] = "lo"
        self.broken(lo, "loopback")

    def test_gpu_device_without_gpu(self):
        def cuda(d):
            c = self.worker(d)
            c["args"] = [a if not a.startswith("--device=") else "--device=cuda:0" for a in c["args"]]
        self.broken(cuda, "without an nvidia.com/gpu limit")


if __name__ == "__main__":
    unittest.main()
