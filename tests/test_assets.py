"""`python -m moe_comm assets RECIPE`, offline: a local HTTP server stands in for the Hugging
Face hub (tests/fake_hub.py, HF_ENDPOINT), serving the repos the flagship recipe names.

- The tokenizer files, and only those, land in [model] hf_assets_path; TorchTitan's tokenizer
  loads them.
- c4's shards named by [assets] dataset_files, and only those, land in [training] dataset_path
  with a dataset card, and TorchTitan's own c4 loader reads them from there, one whole file per
  data-parallel rank.
- A second run fetches nothing; `check` then passes the recipe's path checks.
- Without the hub (offline, unreachable, no such repo) the verb says what is missing, where it
  goes and what to do, and exits 1.
"""

import gzip
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from fake_hub import FakeHub
from in_process import run_verb

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = "recipes/deepseek_v3_671b_b200.toml"
TINY = REPO / "assets" / "tiny"


def _gz_lines(texts: list[str]) -> bytes:
    return gzip.compress("".join(json.dumps({"text": t, "timestamp": "2019", "url": "u"}) + "\n" for t in texts).encode())


def _hub_repos() -> dict:
    c4 = {f"en/c4-train.{i:05d}-of-01024.json.gz": _gz_lines([f"train shard {i} doc {j}" for j in range(3)])
          for i in range(40)}
    c4 |= {f"en/c4-validation.{i:05d}-of-00008.json.gz": _gz_lines([f"validation {i}"]) for i in range(2)}
    c4 |= {"en.noblocklist/c4-train.00000-of-01024.json.gz": _gz_lines(["other variant"]),
           "README.md": b"---\nlicense: odc-by\n---\nthe hub's own card\n"}
    return {
        ("model", "deepseek-ai/DeepSeek-V3"): {
            "tokenizer.json": (TINY / "tokenizer.json").read_bytes(),
            "tokenizer_config.json": (TINY / "tokenizer_config.json").read_bytes(),
            "model-00001-of-00163.safetensors": b"weights that must stay on the hub",
        },
        ("dataset", "allenai/c4"): c4,
    }


def _assets(tmp_path, env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    """`python -m moe_comm assets FLAGSHIP ...` with the hub settings of `env_extra`, run in this
    process (a fresh one spends 10-25 s importing TorchTitan here): huggingface_hub reads
    HF_ENDPOINT, HF_HUB_OFFLINE and HF_HOME into its constants when it is imported, so they are
    set there, for this call only."""
    from huggingface_hub import constants

    endpoint = env_extra.get("HF_ENDPOINT", constants._HF_DEFAULT_ENDPOINT).rstrip("/")
    settings = {"ENDPOINT": endpoint,
                "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                "HF_HUB_OFFLINE": env_extra.get("HF_HUB_OFFLINE") == "1",
                "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub"),
                "HF_HUB_DISABLE_TELEMETRY": True}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.items():
            mp.setattr(constants, name, value)
        return run_verb("assets", FLAGSHIP, "--model.hf_assets_path", str(tmp_path / "tok"),
                        "--training.dataset_path", str(tmp_path / "c4"), *args, cwd=REPO)


def test_fetches_the_flagships_tokenizer_and_stages_its_c4_shards(tmp_path, monkeypatch):
    with FakeHub(_hub_repos()) as hub:
        dry = _assets(tmp_path, {"HF_ENDPOINT": hub.url}, "--dry-run")
        assert dry.returncode == 1 and "would fetch from allenai/c4 (dataset)" in dry.stdout, dry.stdout
        assert not hub.fetched()
        proc = _assets(tmp_path, {"HF_ENDPOINT": hub.url})
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        fetched = sorted(p.split("/resolve/")[1].split("/", 1)[1] for p in hub.fetched())
        again = _assets(tmp_path, {"HF_ENDPOINT": hub.url})
        assert again.returncode == 0 and len(hub.fetched()) == len(fetched)  # nothing twice
    assert "tokenizer  ok" in again.stdout and "dataset    ok" in again.stdout

    train = [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(32)]
    assert fetched == sorted(["tokenizer.json", "tokenizer_config.json", *train,
                              "en/c4-validation.00000-of-00008.json.gz"])

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assert HuggingFaceTokenizer(str(tmp_path / "tok")).encode("hello", add_bos=True, add_eos=True)

    from datasets.distributed import split_dataset_by_node
    from torchtitan.hf_datasets.text_datasets import DATASETS

    train_ds = DATASETS["c4"].loader(str(tmp_path / "c4"))  # TorchTitan's own: name="en", streaming
    assert train_ds.n_shards == 32
    docs = [sample["text"] for sample in split_dataset_by_node(train_ds, rank=5, world_size=32)]
    assert docs == [f"train shard 5 doc {j}" for j in range(3)]  # rank 5 reads shard 5, whole
    validation = DATASETS["c4_validation"].loader(str(tmp_path / "c4"))
    assert [s["text"] for s in validation] == ["validation 0"]

    from moe_comm.__main__ import main

    monkeypatch.chdir(REPO)
    from moe_comm import machine

    monkeypatch.setattr(machine, "refusal", lambda *a, **k: "")  # the files only: this machine has no B200
    assert main(["check", FLAGSHIP, "--model.hf_assets_path", str(tmp_path / "tok"),
                 "--training.dataset_path", str(tmp_path / "c4")]) == 0


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_without_the_hub_it_says_what_is_missing_and_where(tmp_path, how):
    env = {"HF_HUB_OFFLINE": "1"} if how == "offline" else {"HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = _assets(tmp_path, env)
    assert proc.returncode == 1
    out = proc.stdout
    assert f"tokenizer  missing  {tmp_path / 'tok'}: tokenizer.json, tokenizer_config.json" in out
    assert f"dataset    missing  {tmp_path / 'c4'}: en/c4-train.0000?-of-01024.json.gz" in out
    assert "could not reach the Hugging Face hub" in out
    assert f"copy the files of deepseek-ai/DeepSeek-V3 into {tmp_path / 'tok'} by hand" in out


def test_an_unknown_repo_is_named(tmp_path):
    with FakeHub({}) as hub:
        proc = _assets(tmp_path, {"HF_ENDPOINT": hub.url}, "--assets.tokenizer_repo", "nobody/nothing")
    assert proc.returncode == 1 and "no repo nobody/nothing on the hub" in proc.stdout, proc.stdout


def test_nothing_to_fetch_says_where_to_put_it(tmp_path):
    proc = _assets(tmp_path, {"HF_HUB_OFFLINE": "1"}, "--assets.tokenizer_repo", "", "--assets.dataset_repo", "")
    assert proc.returncode == 1
    assert "[assets] tokenizer_repo is empty: put the files there by hand" in proc.stdout
    assert f"dataset    missing  {tmp_path / 'c4'}: the dataset" in proc.stdout


def test_check_names_the_assets_verb_for_a_missing_tokenizer(capsys, monkeypatch):
    from moe_comm.__main__ import main

    monkeypatch.chdir(REPO)
    assert main(["check", FLAGSHIP]) == 1  # the plan is printed, then the launch blockers
    out = capsys.readouterr().out
    assert f"`python -m moe_comm assets {FLAGSHIP}` fetches" in out, out


def test_the_flagship_reads_its_data_from_the_nodesets_shared_mount():
    """soperator/nodeset-b200.yaml mounts the data volume on every worker; the flagship recipes
    read c4 from there, not from the hub."""
    import tomllib

    nodeset = yaml.safe_load((REPO / "soperator" / "nodeset-b200.yaml").read_text())
    mounts = [m["mountPath"] for m in nodeset["spec"]["slurmd"]["volumes"]["jailSubMounts"]]
    for name in ("deepseek_v3_671b_b200.toml", "deepseek_v3_671b_b200_mxfp8.toml"):
        toml = tomllib.loads((REPO / "recipes" / name).read_text())
        path = toml["training"]["dataset_path"]
        assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (name, path, mounts)
        assert toml["assets"]["dataset_repo"] == "allenai/c4" and toml["assets"]["dataset_config"] == "en"
