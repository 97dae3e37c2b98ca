"""The cluster configs in cluster/ pass the checks their tools make, offline.

Launcher YAMLs go through what `ray up` runs before it touches a cloud:
`prepare_config` (merge the provider's defaults; for `local`, derive the node types from the
IPs) and then `validate_config` (Ray's JSON schema `ray/autoscaler/ray-schema.json` plus its
cross-field checks); the file as written is also checked against that schema. For `local` the
whole `ray up` bootstrap runs (it needs no cloud); for AWS the rest needs credentials, so the EC2
`node_config`s are checked against botocore's RunInstances request model instead. Each validator
is also shown to reject broken configs. The RayJob manifest is checked structurally.
"""

import copy
import json
from pathlib import Path

import click
import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")  # comes with ray[default]
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
EXAMPLE = "examples/job_allreduce.py"
LAUNCHER_CONFIGS = ["aws.yaml", "local.yaml"]


def load(name):
    with open(CLUSTER / name) as f:
        return yaml.safe_load(f)


def ray_schema():
    import ray.autoscaler

    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as f:
        return json.load(f)


def ray_up_checks(config):
    """Ray's schema on the file as written, then what `ray up` does to a config before it
    needs the cloud (prepare, validate). Returns the prepared config."""
    jsonschema.validate(config, ray_schema())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_validates(name):
    config = load(name)
    prepared = ray_up_checks(config)
    assert prepared["head_node_type"] in prepared["available_node_types"]
    # raycoll gets installed on every node, the head included, and Ray gets started.
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any("pip install" in c and "raycoll" in c for c in prepared[key]), (key, prepared[key])
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])
    assert any("ray start --address" in c for c in prepared["worker_start_ray_commands"])
    # A checkout installed from a file mount must be the repository root that holds raycoll/.
    for remote, local in config.get("file_mounts", {}).items():
        if any(remote in c for c in config["setup_commands"]):
            assert (REPO / local / "raycoll").is_dir(), (remote, local)
            assert (REPO / local / "pyproject.toml").is_file(), (remote, local)


def test_local_config_full_ray_up_bootstrap():
    """`ray up`'s own bootstrap (prepare, validate, provider bootstrap) for the local provider."""
    from ray.autoscaler._private.commands import _bootstrap_config

    config = load("local.yaml")
    boot = _bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    (node_type,) = boot["available_node_types"].values()
    assert node_type["max_workers"] == len(config["provider"]["worker_ips"])


def _unknown_top_level_key(c):
    c["setup_command"] = c.pop("setup_commands")  # a typo


def _node_type_without_node_config(c):
    del c["available_node_types"][c["head_node_type"]]["node_config"]


def _head_type_not_a_node_type(c):
    c["head_node_type"] = "no.such.type"


def _max_workers_below_min_workers(c):
    c["max_workers"] = 0  # smaller than the workers' min_workers


def _setup_commands_not_a_list(c):
    c["setup_commands"] = "pip install raycoll"


@pytest.mark.parametrize("breakage", [_unknown_top_level_key, _node_type_without_node_config,
                                      _head_type_not_a_node_type, _max_workers_below_min_workers,
                                      _setup_commands_not_a_list])
def test_aws_validator_rejects_broken_config(breakage):
    config = load("aws.yaml")
    breakage(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_up_checks(config)


@pytest.mark.parametrize("breakage", [
    lambda c: c["provider"].pop("head_ip"),
    lambda c: c.update(available_node_types={"x": {"node_config": {}, "resources": {}}}),
    lambda c: c.update(idle_timeout_minutes="five"),
])
def test_local_validator_rejects_broken_config(breakage):
    config = load("local.yaml")
    breakage(config)
    # prepare_local aborts through Ray's CLI logger, which raises a click exception.
    with pytest.raises((jsonschema.ValidationError, ValueError, click.ClickException)):
        ray_up_checks(config)


def _run_instances_errors(node_config):
    botocore_session = pytest.importorskip(
        "botocore.session", reason="needs botocore (AWS's SDK, not in the [test] extra) to "
        "check the EC2 node configs against the RunInstances schema: pip install botocore")
    from botocore.validate import ParamValidator

    model = botocore_session.get_session().get_service_model("ec2")
    shape = model.operation_model("RunInstances").input_shape
    # Ray's AWS provider adds the counts (and tags, ImageId) when it launches a node.
    report = ParamValidator().validate({**node_config, "MinCount": 1, "MaxCount": 1}, shape)
    return report.generate_report() if report.has_errors() else ""


@pytest.mark.parametrize("node_type", ["ray.head.default", "ray.worker.default"])
def test_aws_node_config_is_a_valid_run_instances_request(node_type):
    node_config = load("aws.yaml")["available_node_types"][node_type]["node_config"]
    assert _run_instances_errors(node_config) == ""


def test_aws_node_config_check_rejects_a_typo():
    node_config = dict(load("aws.yaml")["available_node_types"]["ray.head.default"]["node_config"])
    node_config["InstanceTyp"] = node_config.pop("InstanceType")
    assert "InstanceTyp" in _run_instances_errors(node_config)


# --- KubeRay RayJob ---------------------------------------------------------------------

def rayjob_problems(doc):
    """Structural problems of a RayJob that runs the example; [] when it looks right."""
    problems = []
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayJob":
        problems.append(f"apiVersion/kind: {doc.get('apiVersion')}/{doc.get('kind')}")
    if not doc.get("metadata", {}).get("name"):
        problems.append("metadata.name missing")
    spec = doc.get("spec") or {}
    entrypoint = str(spec.get("entrypoint", "")).split()
    if entrypoint[:1] not in (["python"], ["python3"]) or EXAMPLE not in entrypoint:
        problems.append(f"entrypoint does not run {EXAMPLE}: {spec.get('entrypoint')!r}")
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    provides = [str(runtime_env.get("working_dir", ""))] + [str(p) for p in runtime_env.get("pip", [])]
    if not any("raycoll" in p for p in provides):
        problems.append(f"runtime env provides no raycoll: {runtime_env}")
    cluster = spec.get("rayClusterSpec") or {}
    version = str(cluster.get("rayVersion", ""))
    if not version:
        problems.append("rayClusterSpec.rayVersion missing")
    groups = [("headGroupSpec", cluster.get("headGroupSpec"))]
    workers = cluster.get("workerGroupSpecs") or []
    if not workers:
        problems.append("rayClusterSpec.workerGroupSpecs missing or empty")
    for i, w in enumerate(workers):
        groups.append((f"workerGroupSpecs[{i}]", w))
        if not w.get("groupName"):
            problems.append(f"workerGroupSpecs[{i}].groupName missing")
        if not w.get("minReplicas", 0) <= w.get("replicas", 0) <= w.get("maxReplicas", 0):
            problems.append(f"workerGroupSpecs[{i}]: need minReplicas <= replicas <= maxReplicas")
    for where, group in groups:
        if not isinstance(group, dict):
            problems.append(f"{where} missing")
            continue
        if "rayStartParams" not in group:
            problems.append(f"{where}.rayStartParams missing")
        containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            problems.append(f"{where}: no containers")
        for c in containers:
            image = str(c.get("image", ""))
            if not c.get("name") or not image:
                problems.append(f"{where}: container without name or image")
            elif image.startswith("rayproject/") and f":{version}" not in image:
                problems.append(f"{where}: image {image} is not Ray {version}")
            res = c.get("resources") or {}
            if not all(k in res.get(kind, {})
                       for kind in ("requests", "limits") for k in ("cpu", "memory")):
                problems.append(f"{where}: container {c.get('name')} "
                                "lacks cpu/memory requests and limits")
    return problems


def test_rayjob_manifest():
    with open(CLUSTER / "rayjob.yaml") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    (doc,) = [d for d in docs if d.get("kind") == "RayJob"]
    assert rayjob_problems(doc) == []
    assert (REPO / EXAMPLE).is_file()


def _head_container(d):
    return d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _worker_container(d):
    return d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("breakage", [
    lambda d: d.update(apiVersion="ray.io/v1alpha1"),
    lambda d: d["spec"].update(entrypoint="python other.py"),
    lambda d: d["spec"].update(runtimeEnvYAML="env_vars: {A: b}"),
    lambda d: d["spec"]["rayClusterSpec"].pop("headGroupSpec"),
    lambda d: d["spec"]["rayClusterSpec"].update(workerGroupSpecs=[]),
    lambda d: _head_container(d).pop("image"),
    lambda d: _worker_container(d).pop("resources"),
    lambda d: d["spec"]["rayClusterSpec"].update(rayVersion="2.9.0"),
])
def test_rayjob_check_rejects_broken_manifest(breakage):
    with open(CLUSTER / "rayjob.yaml") as f:
        doc = yaml.safe_load(f)
    breakage(doc)
    assert rayjob_problems(doc) != []


def test_ray_versions_agree():
    """The Ray version pinned in the three configs is one and the same."""
    aws_image = load("aws.yaml")["docker"]["image"]
    local_pins = [c for c in load("local.yaml")["setup_commands"] if "ray[default]==" in c]
    with open(CLUSTER / "rayjob.yaml") as f:
        rayjob_version = yaml.safe_load(f)["spec"]["rayClusterSpec"]["rayVersion"]
    assert aws_image.split(":")[1].startswith(rayjob_version + "-")
    assert local_pins and all(f"ray[default]=={rayjob_version}" in c for c in local_pins)
