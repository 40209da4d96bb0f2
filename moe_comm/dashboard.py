"""`python -m moe_comm dashboard --project P`: a W&B workspace that compares backends.

Built with `wandb-workspaces` (W&B's maintained library for saved workspaces and reports; the
optional extra `moe-comm[dashboard]`). Runs are grouped by setting (the W&B run group: the
recipe with its nodes, batch and dtypes, see moe_comm.metrics.naming) and then by backend, so each chart shows one line or bar per backend:
MFU, tokens/s per GPU, the share of the step MoE comm is not hidden, memory, and the comm
breakdown. With an API key (and network) the workspace is saved and its URL printed; without,
the spec it would save is written to a JSON file instead, and the command says so.
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

from moe_comm.metrics import keys
from moe_comm.metrics.naming import DEFAULT_PROJECT

PLACEHOLDER_ENTITY = "YOUR_WANDB_ENTITY"


def _sections(ws, wr) -> list:
    comparison = [
        wr.BarPlot(title="MFU (%)", metrics=[keys.MFU], groupby_aggfunc="mean"),
        wr.BarPlot(title="tokens/s per GPU", metrics=[keys.TPS], groupby_aggfunc="mean"),
        wr.BarPlot(title="MoE comm not hidden (% of step)", metrics=[keys.COMM_EXPOSED_PCT],
                   groupby_aggfunc="mean"),
        wr.BarPlot(title="max reserved memory (GiB)", metrics=[keys.MEM_RESERVED], groupby_aggfunc="max"),
    ]
    over_steps = [
        wr.LinePlot(title="MFU (%)", x="Step", y=[keys.MFU]),
        wr.LinePlot(title="tokens/s per GPU", x="Step", y=[keys.TPS]),
        wr.LinePlot(title="MoE comm not hidden (% of step)", x="Step", y=[keys.COMM_EXPOSED_PCT]),
        wr.LinePlot(title="max reserved memory (GiB)", x="Step", y=[keys.MEM_RESERVED]),
        wr.LinePlot(title="loss", x="Step", y=[keys.LOSS]),
        wr.LinePlot(title="step time (ms)", x="Step", y=[keys.STEP_MS]),
    ]
    comm = [
        wr.LinePlot(title="dispatch / combine (ms per step, fwd+bwd)", x="Step",
                    y=[keys.DISPATCH_MS, keys.COMBINE_MS]),
        wr.LinePlot(title="forward vs backward comm (ms per step)", x="Step",
                    y=[keys.DISPATCH_FWD_MS, keys.DISPATCH_BWD_MS, keys.COMBINE_FWD_MS, keys.COMBINE_BWD_MS]),
        wr.LinePlot(title="GB leaving each rank per step", x="Step", y=[keys.SENT_GB]),
        wr.LinePlot(title="comm bandwidth seen by the compute stream (GB/s)", x="Step", y=[keys.COMM_BW]),
        wr.LinePlot(title="token imbalance (max/mean)", x="Step",
                    y=[keys.IMBALANCE_RANK, keys.IMBALANCE_EXPERT]),
    ]
    return [
        ws.Section(name="Backend comparison", panels=comparison, is_open=True),
        ws.Section(name="Over steps", panels=over_steps, is_open=True),
        ws.Section(name="MoE communication", panels=comm, is_open=True),
    ]


def build_workspace(entity: str, project: str, name: str, recipe: str | None = None):
    """The workspace object; nothing is sent until `.save()`."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    runset = ws.RunsetSettings(
        groupby=[expr.Metric("Group"), expr.Config("moe_comm.backend")],
        filters=[expr.Config(f"moe_comm_run.{keys.RECIPE}") == recipe] if recipe else [],
        pinned_columns=[f"summary:{keys.MFU}", f"summary:{keys.TPS}",
                        f"summary:{keys.COMM_EXPOSED_PCT}", "config:moe_comm.backend"],
    )
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=_sections(ws, wr),
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=50),
        runset_settings=runset,
    )


def workspace_spec(workspace) -> dict[str, Any]:
    """What would be saved: the workspace as built, and the view W&B's API would receive."""
    import wandb_workspaces.workspaces as ws
    from pydantic import TypeAdapter

    spec: dict[str, Any] = {"workspace": TypeAdapter(ws.Workspace).dump_python(workspace, mode="json")}
    # the wire form save() uploads (a private method of the library; best effort)
    try:
        spec["view"] = json.loads(workspace._to_model().model_dump_json(by_alias=True, exclude_none=True))
    except Exception as e:  # noqa: BLE001 - the public form above is the spec; this is extra
        spec["view_error"] = f"{type(e).__name__}: {e}"
    return spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--project", default=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
                        help="W&B project the runs were logged to")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"),
                        help="W&B user or team (default: WANDB_ENTITY, else your default entity)")
    parser.add_argument("--name", default="MoE comm backends", help="workspace name")
    parser.add_argument("--recipe", help="show only this recipe's runs (e.g. debug_cpu: its file's stem)")
    parser.add_argument("--out", type=Path, default=Path("wandb_dashboard_spec.json"),
                        help="where the spec goes when it cannot be saved to W&B")
    parser.add_argument("--offline", action="store_true", help="write the spec even with an API key")


def main(args: argparse.Namespace) -> int:
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        print("dashboard: needs wandb-workspaces: pip install 'moe-comm[dashboard]' (or wandb-workspaces)")
        return 1
    from moe_comm.metrics.naming import wandb_logged_in

    logged_in = wandb_logged_in()
    online = logged_in and not args.offline
    entity = args.entity
    reason = "no W&B credentials: no WANDB_API_KEY, no `wandb login`" if not logged_in else "--offline"
    if online and not entity:
        try:
            import wandb

            entity = wandb.Api().default_entity
        except Exception as e:  # noqa: BLE001 - no network: fall back to the spec file
            online, reason = False, f"cannot reach W&B ({type(e).__name__}: {e})"
    workspace = build_workspace(entity or PLACEHOLDER_ENTITY, args.project, args.name, args.recipe)
    if online:
        try:
            workspace.save()
            print(f"dashboard: saved workspace {args.name!r}: {workspace.url}")
            return 0
        except Exception as e:  # noqa: BLE001 - any API/network failure: keep the spec
            reason = f"saving failed ({type(e).__name__}: {e})"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(workspace_spec(workspace), indent=2) + "\n")
    print(
        f"dashboard: not saved to W&B ({reason}). Wrote the workspace spec it would create for "
        f"project {args.project!r} (entity {entity or PLACEHOLDER_ENTITY!r}) to {args.out}. "
        f"To create it: `wandb login` (or export WANDB_API_KEY=...) and run "
        f"`python -m moe_comm dashboard --project {args.project}"
        + (f" --entity {entity}" if entity else " --entity YOUR_ENTITY") + "`."
    )
    return 0
