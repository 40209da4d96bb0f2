"""`python -m moe_comm assets RECIPE.toml`: put on disk what the recipe reads from disk.

A recipe reads a tokenizer from `[model] hf_assets_path` and its data from `[training]
dataset_path` (or streams a Hugging Face dataset). The recipe's `[assets]` section says where
those come from on the Hugging Face hub; this verb fetches what is missing with huggingface_hub
(the files only, into the recipe's own folders), or says exactly what is missing and where to
put it. Run it once on a machine with network, e.g. a Soperator login node, where the jail
and /data are the same files every worker sees.

- Tokenizer: `[assets] tokenizer_files` of `tokenizer_repo` (a model repo) into hf_assets_path.
- Dataset: when dataset_path is a local folder and `dataset_repo` is set, the repo's files
  matching `dataset_files` (huggingface_hub allow-patterns) go into that folder, with a dataset
  card (README.md) that declares them as the `[assets] dataset_config` configuration, split by
  file name, so TorchTitan's own loader (`load_dataset(dataset_path, name=..., split="train",
  streaming=True)`) reads them as it would read the hub's copy. A training job then streams
  from the shared filesystem instead of 256 ranks streaming from the hub at start-up.

Exit status: 0 when everything the recipe needs is on disk afterwards, 1 when something is
missing (each missing item printed with the fix), 2 for a recipe error.
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_comm import recipe

CARD_NAME = "README.md"
# How the dataset card tells splits apart: the hub's own rule (a split's name in the file name).
SPLITS = ("train", "validation", "test")


@dataclass
class Item:
    """One thing the recipe reads: where it must be, what is missing there, where it comes from."""

    what: str  # "tokenizer" or "dataset"
    folder: str
    missing: list[str]
    source: str = ""  # "repo_id (model)" / "repo_id (dataset)", or "" when nothing can fetch it
    note: str = ""  # why nothing can fetch it
    streamed: bool = False  # a hub dataset that every rank streams at start-up: nothing to fetch
    fetched: list[str] = field(default_factory=list)


def _local(path: str) -> bool:
    """recipe.py's rule: a dataset_path starting with . or / is a folder, anything else a hub id."""
    return path.startswith((".", "/"))


def split_of(path: str) -> str:
    name = Path(path).name
    return next((s for s in SPLITS if s in name), "train")


def write_card(folder: Path, config: str, files: list[str]) -> Path:
    """A dataset card declaring `files` (relative to `folder`) as configuration `config`."""
    by_split: dict[str, list[str]] = {}
    for f in sorted(files):
        by_split.setdefault(split_of(f), []).append(f)
    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, paths in by_split.items():
        lines += [f"  - split: {split}", "    path:"] + [f"    - {p}" for p in paths]
    lines += [
        "---",
        "",
        "Staged by `python -m moe_comm assets`: the files above, as they are on the hub.",
        "",
    ]
    card = folder / CARD_NAME
    card.write_text("\n".join(lines))
    return card


def _card_files(folder: Path) -> list[str]:
    """The data files a card written by `write_card` declares ([] without a card)."""
    card = folder / CARD_NAME
    if not card.is_file():
        return []
    return [line.strip()[2:] for line in card.read_text().split("---")[1].splitlines()
            if line.startswith("    - ")]


def plan(r: recipe.Recipe) -> list[Item]:
    c = r.config
    assets = c.assets
    tokenizer_folder = c.model.hf_assets_path
    missing = [f for f in assets.tokenizer_files if not os.path.isfile(os.path.join(tokenizer_folder, f))]
    items = [Item(
        "tokenizer", tokenizer_folder, missing,
        source=f"{assets.tokenizer_repo} (model)" if assets.tokenizer_repo else "",
        note="" if assets.tokenizer_repo else "[assets] tokenizer_repo is empty",
    )]

    t = c.training
    if not t.dataset_path or not _local(t.dataset_path):
        hub_id = t.dataset_path or f"TorchTitan's default for dataset {t.dataset!r}"
        items.append(Item("dataset", hub_id, [], streamed=True))
        return items
    folder = Path(t.dataset_path)
    if assets.dataset_repo:
        # staged = the card that `fetch` writes last, and every file it declares
        declared = _card_files(folder)
        staged = bool(declared) and all((folder / f).is_file() for f in declared)
        missing = [] if staged else list(assets.dataset_files)
        items.append(Item("dataset", t.dataset_path, missing, source=f"{assets.dataset_repo} (dataset)"))
    else:
        missing = [] if folder.exists() else ["the dataset"]
        items.append(Item("dataset", t.dataset_path, missing, note="[assets] dataset_repo is empty"))
    return items


class HubError(Exception):
    """A download that did not happen, said in the user's terms with the fix."""


def _download(repo_id: str, repo_type: str, patterns: list[str], folder: str) -> None:
    """The files of `repo_id` matching `patterns` into `folder` (huggingface_hub skips what is
    there already, so an interrupted run resumes)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns, local_dir=folder)
    except GatedRepoError as e:
        raise HubError(f"{repo_id} is gated: accept its terms on huggingface.co, then `hf auth login` "
                       "(or set HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        raise HubError(f"no repo {repo_id} on the hub (or it is private: `hf auth login`); check [assets]") from e
    except LocalEntryNotFoundError as e:  # what huggingface_hub raises when the hub is out of reach
        raise HubError(f"could not reach the Hugging Face hub ({type(e).__name__}); run this on a machine "
                       f"with network, or copy the files of {repo_id} into {folder} by hand") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(f"{repo_id}: {type(e).__name__}: {e}") from e


def fetch_tokenizer(r: recipe.Recipe, item: Item) -> None:
    assets = r.config.assets
    _download(assets.tokenizer_repo, "model", item.missing, item.folder)
    item.fetched = [f for f in item.missing if os.path.isfile(os.path.join(item.folder, f))]
    item.missing = [f for f in item.missing if f not in item.fetched]
    if item.missing:
        raise HubError(f"{assets.tokenizer_repo} has no {', '.join(item.missing)}; fix [assets] tokenizer_files")


def fetch_dataset(r: recipe.Recipe, item: Item) -> None:
    """The dataset files into the folder, then the card that declares them (written last, so a
    card means a complete folder)."""
    import fnmatch

    assets = r.config.assets
    _download(assets.dataset_repo, "dataset", list(assets.dataset_files), item.folder)
    folder = Path(item.folder)
    # what is in the folder now (huggingface_hub keeps its own bookkeeping under .cache/)
    present = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    staged = sorted(
        f for f in present
        if not f.startswith(".cache/") and any(fnmatch.fnmatch(f, pat) for pat in assets.dataset_files)
    )
    if not staged:
        raise HubError(f"no file of {assets.dataset_repo} matches [assets] dataset_files = {list(assets.dataset_files)}")
    write_card(folder, assets.dataset_config, staged)
    item.fetched, item.missing = staged, []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file")
    _add_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides, e.g. --model.hf_assets_path DIR")


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what is missing and where it would come from; fetch nothing")


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_flags)
    try:
        # Only the recipe's paths and [assets] matter here: validate it as for the GPUs, the
        # superset of what a CPU machine (say, a login node) accepts.
        r = recipe.load(args.recipe, overrides, device="cuda", check_paths=False)
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    ok = True
    for item in plan(r):
        if item.streamed:
            print(f"{item.what:9}  hub      {item.folder}: streamed by every data-parallel rank at start-up "
                  "(to stage it: a folder in [training] dataset_path, [assets] dataset_repo and dataset_files)")
            continue
        if not item.missing:
            print(f"{item.what:9}  ok       {item.folder}")
            continue
        what = f"{item.what:9}  missing  {item.folder}: {', '.join(item.missing)}"
        if not item.source:
            print(f"{what}\n           {item.note}: put the files there by hand, or name their hub repo in [assets]")
            ok = False
            continue
        if args.dry_run:
            print(f"{what}\n           would fetch from {item.source}")
            ok = False
            continue
        print(f"{item.what:9}  fetching {item.source} -> {item.folder}", flush=True)
        try:
            (fetch_tokenizer if item.what == "tokenizer" else fetch_dataset)(r, item)
        except HubError as e:
            print(f"{what}\n           {e}")
            ok = False
        else:
            print(f"{item.what:9}  ok       {item.folder}: {len(item.fetched)} file(s) in place")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(argparse.ArgumentParser().parse_args()))
