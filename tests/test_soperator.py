"""soperator/ against Soperator's own CRDs and Helm charts (../shared/soperator-reference).

Why both checks and a strict one: Kubernetes prunes fields a CRD's schema does not know, and
Helm ignores values keys a chart never reads, so a typo (gdrcopyEnabled) silently loses the
setting. jsonschema checks types and enums; the walks below also refuse unknown keys.
"""

import functools
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from moe_comm.cluster.sbatch import REPO

ENV_VAR = "SOPERATOR_REFERENCE_DIR"
SOPERATOR = REPO / "soperator"


@pytest.fixture(scope="module")
def reference() -> Path:
    """Soperator's CRDs and chart values live outside the repo: without them these tests skip
    (a fresh clone passes), and CI, which sets SOPERATOR_REFERENCE_DIR, runs them. A folder that is
    named but incomplete is an error, not a skip."""
    value = os.environ.get(ENV_VAR)
    if not value:
        pytest.skip(
            f"{ENV_VAR} is not set: these tests check soperator/ against Soperator's own CRDs and chart "
            "values. To run them, copy from the nebius/soperator repository into one folder "
            "config/crd/bases/slurm.nebius.ai_slurmclusters.yaml as slurmclusters.crd.yaml, "
            "config/crd/bases/slurm.nebius.ai_nodesets.yaml as nodesets.crd.yaml, "
            "helm/slurm-cluster/values.yaml as slurm-cluster.values.yaml and helm/nodesets/values.yaml "
            f"as nodesets.values.yaml, then export {ENV_VAR}=that/folder (CI sets it)"
        )
    path = Path(value)
    needed = ["slurmclusters.crd.yaml", "nodesets.crd.yaml", "slurm-cluster.values.yaml"]
    missing = [n for n in needed if not (path / n).is_file()]
    if missing:
        pytest.fail(f"{ENV_VAR}={value} lacks {missing}")
    return path


SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 37k lines


@functools.lru_cache(maxsize=None)
def _read_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=SafeLoader)


def crd_schema(reference: Path, name: str) -> dict:
    crd = _read_yaml(reference / name)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
            "version": version["name"], "schema": version["schema"]["openAPIV3Schema"]}


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Paths in value that the structural schema would prune (no property, no open map)."""
    out = []
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                out += unknown_fields(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(sub, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def unknown_values_keys(override, default, path: str = "") -> list[str]:
    """Keys of a Helm override that the chart's values.yaml does not have.

    Where the chart's default is empty or null (a free-form map or list, e.g. `partitions: []`)
    anything below is accepted; list items are compared with the union of the default items' keys."""
    if default in (None, {}, []):
        return []
    out = []
    if isinstance(override, dict) and isinstance(default, dict):
        for key, sub in override.items():
            if key not in default:
                out.append(f"{path}.{key}")
            else:
                out += unknown_values_keys(sub, default[key], f"{path}.{key}")
    elif isinstance(override, list) and isinstance(default, list):
        merged: dict = {}
        for item in default:
            if isinstance(item, dict):
                merged.update(item)
        if merged:
            for i, item in enumerate(override):
                out += unknown_values_keys(item, merged, f"{path}[{i}]")
    return out


def load(name: str):
    return yaml.safe_load((SOPERATOR / name).read_text())


def test_nodeset_matches_the_crd_schema(reference):
    crd = crd_schema(reference, "nodesets.crd.yaml")
    doc = load("nodeset-b200.yaml")
    assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}" and doc["kind"] == crd["kind"]
    jsonschema.validate(doc, crd["schema"])
    assert unknown_fields(doc, crd["schema"]) == []


def test_nodeset_is_the_671b_cluster(reference):
    spec = load("nodeset-b200.yaml")["spec"]
    assert spec["replicas"] == 32 and spec["slurmd"]["resources"]["nvidia.com/gpu"] == 8
    assert spec["gpu"] == {"enabled": True, "nvidia": {"gdrCopyEnabled": True}}
    assert spec["slurmd"]["volumes"]["sharedMemorySize"] == "256Gi"
    (data,) = [m for m in spec["slurmd"]["volumes"]["jailSubMounts"] if m["name"] == "data"]
    assert data["mountPath"] == "/data" and "persistentVolumeClaim" in data["volumeSource"]
    assert "memlock unlimited" in spec["slurmd"]["security"]["limitsConfig"], "IBGDA needs unlimited locked memory"


def test_validation_catches_a_typo(reference):
    """The checks themselves: a misspelled flag is reported, a wrong type is refused."""
    crd = crd_schema(reference, "nodesets.crd.yaml")
    doc = load("nodeset-b200.yaml")
    doc["spec"]["gpu"]["nvidia"]["gdrcopyEnabled"] = doc["spec"]["gpu"]["nvidia"].pop("gdrCopyEnabled")
    assert unknown_fields(doc, crd["schema"]) == [".spec.gpu.nvidia.gdrcopyEnabled"]
    doc = load("nodeset-b200.yaml")
    doc["spec"]["updateStrategy"] = "recreate"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, crd["schema"])
    values = load("values-slurm-cluster.yaml")
    values["plugStackConfig"]["pyxis"]["requierd"] = True
    chart = _read_yaml(reference / "slurm-cluster.values.yaml")
    assert unknown_values_keys(values, chart) == [".plugStackConfig.pyxis.requierd"]


def test_slurm_cluster_values_are_chart_keys(reference):
    chart = _read_yaml(reference / "slurm-cluster.values.yaml")
    values = load("values-slurm-cluster.yaml")
    assert unknown_values_keys(values, chart) == []


def test_slurm_cluster_values_match_the_crd_where_the_chart_copies_them(reference):
    """These value sections are copied into the SlurmCluster spec as they are; check them there."""
    spec_schema = crd_schema(reference, "slurmclusters.crd.yaml")["schema"]["properties"]["spec"]
    values = load("values-slurm-cluster.yaml")
    for key in ("partitionConfiguration", "plugStackConfig", "k8sNodeFilters", "volumeSources"):
        jsonschema.validate(values[key], spec_schema["properties"][key])
        assert unknown_fields(values[key], spec_schema["properties"][key]) == [], key


def test_cluster_values_and_nodeset_agree():
    values = load("values-slurm-cluster.yaml")
    nodeset = load("nodeset-b200.yaml")
    assert nodeset["spec"]["clusterName"] == values["clusterName"]
    (partition,) = values["partitionConfiguration"]["partitions"]
    assert partition["nodeSetRefs"] == [nodeset["metadata"]["name"]]
    sources = {v["name"]: v for v in values["volumeSources"]}
    (login_data,) = values["slurmNodes"]["login"]["volumes"]["jailSubMounts"]
    (worker_data,) = nodeset["spec"]["slurmd"]["volumes"]["jailSubMounts"]
    assert login_data["mountPath"] == worker_data["mountPath"]
    assert (sources[login_data["volumeSourceName"]]["persistentVolumeClaim"]["claimName"]
            == worker_data["volumeSource"]["persistentVolumeClaim"]["claimName"])


def test_671b_recipe_targets_this_cluster():
    """The recipe's partition (empty = the cluster default) and shape fit the NodeSet."""
    import tomllib

    recipe = tomllib.loads((REPO / "recipes" / "deepseek_v3_671b_b200.toml").read_text())
    cluster = recipe["cluster"]
    nodeset = load("nodeset-b200.yaml")["spec"]
    assert cluster["nodes"] <= nodeset["replicas"]
    assert cluster["gpus_per_node"] == nodeset["slurmd"]["resources"]["nvidia.com/gpu"]
    (partition,) = load("values-slurm-cluster.yaml")["partitionConfiguration"]["partitions"]
    assert cluster.get("partition", "") in ("", partition["name"])
    assert "Default=YES" in partition["config"]
