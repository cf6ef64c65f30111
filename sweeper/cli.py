"""Command line: ``python -m sweeper {plan,trial,migrate,search,report,replan,doctor}`` per docs/ARCHITECTURE.md.

User errors (bad YAML, bad layout strings, impossible clusters, missing files) exit 2 with one line on stderr
and write nothing; a cluster that does not answer exits 1 with one line. Both are ``sweeper.errors.SweeperError``
(raised anywhere in the library, which never imports this module); this is the one place that turns them into a
line and an exit code. Heavy imports (ray, torch, mlflow) happen inside the commands that need them, so ``plan``
stays instant.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sweeper.config.load import load_config, proxy_config, resolve_space_path
from sweeper.config.schema import SweepConfig, check_address_override
from sweeper.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, SweeperError, UsageError

if TYPE_CHECKING:  # imported by the command that uses it (``sweeper --help`` imports no estimator)
    from sweeper.estimate.calibration import Calibration
    from sweeper.plan.shards import Layouts

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--p` is not `--proxy` (a script's typo must not silently pick a different sweep).
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse prints usage + message over two lines; we print one
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code = int(args.func(args))
        # The process's own command line (argv None): the process ends when this returns
        if argv is None and args.func in (cmd_plan, cmd_replan):
            # The estimator's memos stay alive until the process ends, and the interpreter's last cycle collection
            # would walk every object of them (0.13 s of a 0.19 s exit after a 99,360-layout plan, ~0.4 s after a
            # DeepSeek-V3 replan; issue 54). They hold no resource a finaliser must release: left out of it.
            gc.freeze()
        return code
    except SweeperError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `sweeper plan --json | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not raise again
        return EXIT_FAILED


def _one_line(exc: BaseException) -> str:
    # Messages are written as one line; a value quoted from the input may still carry a newline.
    return " ".join(str(exc).split()) or type(exc).__name__


PROXY_HELP = ("use the model's CPU-size proxy (same layers and heads; fewer experts, small widths) with CPU-size "
              "training: proves the layouts' distributed mechanics, not memory or speed")
SPACE_HELP = ("the search YAML (docs/ARCHITECTURE.md); a bare name that is not a file here (quickstart, "
              "nemotron.yaml) is looked up in search_spaces/")
ADDRESS_HELP = "the Ray cluster: auto, local, HOST:PORT or ray://HOST:PORT (overrides cluster.address)"
JSON_HELP = "print the result as one JSON object on stdout (the contract in docs/ARCHITECTURE.md)"
EPILOG = """\
example:
  sweeper plan quickstart                      # every layout, valid or not, with predicted memory
  sweeper trial quickstart --layout tp=2,ep=2  # one smoke run
  sweeper search quickstart                    # the sweep; the winner in sweeps/<name>/best_layout.yaml
  sweeper replan sweeps/quickstart --gpus 8    # the finished sweep re-ranked for an 8-GPU production run

exit codes: 0 done (search: a stable layout found), 1 failed (search: none stable; trial: the layout failed),
2 bad input (one line naming the field), 130 interrupted.
docs: README.md and docs/ in the repository; `sweeper <command> --help` for each command."""


def _layout_help(what: str) -> str:
    from sweeper.space.axes import AXES

    keys = ", ".join(a.name for a in AXES)
    return f'{what}, comma-separated KEY=VALUE, e.g. "tp=2,pp=2,ep=4"; keys: {keys}'


def _load(args: argparse.Namespace) -> SweepConfig:
    """The command's search YAML (a bare name finds a shipped space), as a proxy space with --proxy."""
    path = resolve_space_path(args.space)
    if path != args.space:
        print(f"using {path} (the shipped search space named {args.space})", file=sys.stderr)
    cfg = load_config(path, overrides=args.set)
    return proxy_config(cfg) if getattr(args, "proxy", False) else cfg


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sweeper", formatter_class=argparse.RawDescriptionHelpFormatter,  # --version: one line
                     description="Find the best stable Megatron parallel layout for a model on a cluster.",
                     epilog=EPILOG)
    parser.add_argument("--version", action=_VersionAction,
                        help="print sweeper's version and those of megatron-core, torch, ray, optuna, mlflow, "
                        "transformer-engine and megatron-bridge")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="list every layout of the space, valid or not, with predicted memory")
    plan.add_argument("space", type=Path, help=SPACE_HELP)
    plan.add_argument("--json", action="store_true", help="print one JSON array on stdout, an element per layout")
    plan.add_argument("--only", help=_layout_help("keep the layouts matching these keys"))
    plan.add_argument("--limit", type=int, default=40, help="valid layouts shown in the table (0 = all)")
    plan.add_argument("--proxy", action="store_true", help=PROXY_HELP)
    _add_set(plan)
    plan.set_defaults(func=cmd_plan)

    trial = sub.add_parser("trial", help="run one smoke trial of a layout on the space's cluster")
    trial.add_argument("space", type=Path, help=SPACE_HELP)
    trial.add_argument("--layout", required=True, help=_layout_help("the layout"))
    trial.add_argument("--json", action="store_true", help=JSON_HELP)
    trial.add_argument("--out", type=Path, help="trial folder (default sweeps/<name>/trials/manual-<time>)")
    trial.add_argument("--address", help=ADDRESS_HELP)
    trial.add_argument("--proxy", action="store_true", help=PROXY_HELP)
    _add_set(trial)
    trial.set_defaults(func=cmd_trial)

    migrate = sub.add_parser("migrate", help="move a checkpoint written by one layout into another and prove it: "
                             "same loss on a fixed batch, then steps, save and reload")
    migrate.add_argument("space", type=Path, help=SPACE_HELP)
    migrate.add_argument("--from", dest="source", required=True, metavar="LAYOUT",
                         help=_layout_help("the layout that writes (or wrote) the checkpoint"))
    migrate.add_argument("--to", dest="target", required=True, metavar="LAYOUT",
                         help=_layout_help("the layout to move into"))
    migrate.add_argument("--checkpoint", type=Path, help="a checkpoint sweeper wrote (a sweep's reference/ or a "
                         "migration's from/ folder) instead of writing one with --from")
    migrate.add_argument("--json", action="store_true", help=JSON_HELP)
    migrate.add_argument("--out", type=Path,
                         help="migration folder (default sweeps/<name>/migrations/<from>--<to>-<time>)")
    migrate.add_argument("--address", help=ADDRESS_HELP)
    migrate.add_argument("--proxy", action="store_true", help=PROXY_HELP)
    _add_set(migrate)
    migrate.set_defaults(func=cmd_migrate)

    search = sub.add_parser("search", help="run the sweep and export the best stable layout")
    search.add_argument("space", type=Path, help=SPACE_HELP)
    search.add_argument("--resume", action="store_true", help="continue the sweep recorded in --out")
    search.add_argument("--break-lock", action="store_true",
                        help="take over --out's driver.lock from a driver that is gone (e.g. killed on another host) "
                        "before its heartbeat is stale; refused while a driver still holds it")
    search.add_argument("--out", type=Path, help="sweep folder (default sweeps/<name>/); on a real cluster on a "
                        "filesystem every node mounts at the same path (ranks write their logs and checkpoints there)")
    search.add_argument("--max-trials", type=int, help="override search.max_trials")
    search.add_argument("--parallel", type=int, help="override search.parallel (trials at once)")
    search.add_argument("--address", help=ADDRESS_HELP)
    search.add_argument("--inject", action="append", default=[], metavar="SPEC",
                        help="fault injection on simulated clusters: node-loss@trial=N, node-join@trial=N, "
                        "hang@trial=N, nan@trial=N, kill-rank@trial=N, drift@trial=N (repeatable)")
    search.add_argument("--proxy", action="store_true", help=PROXY_HELP)
    search.add_argument("--rehearse", action="store_true",
                        help="rehearse the sweep: the real driver against trials modelled from the estimator on the "
                        "YAML's cluster, on a virtual clock, no GPU and no Ray; writes rehearsal.json (default --out "
                        "sweeps/<name>-rehearsal/)")
    search.add_argument("--rehearse-faults", metavar="SPEC",
                        help="with --rehearse: node_loss_per_hour=RATE,hang=P,others=SHARE (node losses per "
                        "node-hour of a trial, the chance a trial hangs, the largest share of the nodes other jobs "
                        "hold, drawn anew every hour)")
    loudness = search.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true",
                          help="also show the libraries' log lines (Optuna, MLflow, Ray) on the terminal")
    loudness.add_argument("-q", "--quiet", action="store_true",
                          help="show only failures, warnings and the result (sweep.log keeps everything)")
    _add_set(search)
    search.set_defaults(func=cmd_search)

    report = sub.add_parser("report", help="re-render the report of a sweep folder")
    report.add_argument("dir", type=Path, help="a sweep folder (sweeps/<name>/, or a search's --out)")
    report.set_defaults(func=cmd_report)

    replan = sub.add_parser("replan", help="re-rank a finished sweep's layouts for a production run of another "
                            "GPU count (the measured ones projected, the others predicted); writes nothing to it")
    replan.add_argument("dir", type=Path, help="a finished sweep folder (sweeps/<name>/, or a search's --out)")
    replan.add_argument("--gpus", type=int, help="N: the production run's GPUs (the same as --set budget.gpus=N)")
    replan.add_argument("--json", action="store_true", help=JSON_HELP)
    replan.add_argument("--out", type=Path, help="also write the replan to FILE: YAML for .yaml/.yml, else JSON "
                        "(the --json object)")
    replan.add_argument("--top", type=int, default=10, help="layouts shown in the table (default 10)")
    replan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a budget field of the sweep's YAML (repeatable): budget.gpus, budget.tokens, "
                        "budget.gpu_hour_usd")
    replan.set_defaults(func=cmd_replan)

    doctor = sub.add_parser("doctor", help="check every node of the cluster before any trial")
    doctor.add_argument("space", type=Path, help=SPACE_HELP)
    doctor.add_argument("--address", help=ADDRESS_HELP)
    doctor.add_argument("--out", type=Path, help="where the sweep will write, checked to be shared by every node "
                        "(default sweeps/<name>/, as search)")
    _add_set(doctor)
    doctor.set_defaults(func=cmd_doctor)
    return parser


def _add_set(command: argparse.ArgumentParser) -> None:
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a field of the YAML (repeatable), e.g. --set training.steps=4 "
                         "--set 'space.tp=[1,2]'")


class _VersionAction(argparse.Action):
    """argparse's ``version`` action with the versions read when it is given, not on every command (the installed
    metadata of eight distributions: about 12 ms a run)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        print(_versions())
        parser.exit()


def _versions() -> str:
    """sweeper's version and those of the stack it drives (from the installed metadata: no import)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    stack = ", ".join(f"{name} {version(name)}" for name in
                      ("megatron-core", "torch", "ray", "optuna", "mlflow", "transformer-engine", "megatron-bridge"))
    return f"sweeper {version('sweeper')} ({stack})"


# -- plan ---------------------------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from sweeper.plan.space import only_filter

    if args.limit < 0:
        raise UsageError(f"--limit: must be 0 (all) or a positive integer, got {args.limit}")
    cfg = _load(args)
    only = only_filter(args.only)
    from sweeper.estimate.calibrator import stored
    from sweeper.estimate.term_table import without_cycle_collection
    from sweeper.plan.assess import space_layouts
    from sweeper.plan.shards import Listed
    from sweeper.plan.space import SpaceProduct

    calibration, calibrated = stored(cfg)  # what earlier sweeps on this cluster measured
    # A plan is one large tree of values without cycles (layouts, entries, estimates, their JSON): the cycle
    # collector's passes over it find nothing, and were a third of a DeepSeek-V3 plan's CPU (issue 54). The tree is
    # gone (``_show_plan`` returned) before the collector runs again: alive, its first pass would walk all of it.
    with without_cycle_collection():
        # The whole space's layouts are built where they are judged (a large space's by each worker, its own)
        _show_plan(args, cfg, Listed(space_layouts(cfg, only)) if only else SpaceProduct(cfg), only, calibration,
                   calibrated)
    return EXIT_OK


def _show_plan(args: argparse.Namespace, cfg: SweepConfig, layouts: Layouts, only: dict[str, Any],
               calibration: Calibration | None, calibrated: str | None) -> None:
    if only and not len(layouts):
        raise UsageError(_nothing_matched(cfg, only))
    if calibrated:  # on stderr: --json keeps stdout one JSON array
        print(calibrated, file=sys.stderr)
    # A large space's JSON or table is made on the cores this process may use (sweeper/plan/shards.py)
    if args.json:
        from sweeper.plan.shards import plan_json_text

        _write_json_array(plan_json_text(cfg, layouts, calibration))
        return
    from sweeper.ui.plan_table import plan_table
    from sweeper.ui.views import print_plan

    print_plan(cfg, plan_table(cfg, layouts, calibration), limit=args.limit)


def _write_json_array(text: Iterable[bytes | memoryview]) -> None:
    """One JSON array on stdout, one line, from the text of its elements a piece at a time (each piece elements
    separated by commas, as ``Plan.json_text`` makes them; an empty piece has none): each piece freed before the next
    is made. Written as bytes where stdout takes them."""
    binary = hasattr(sys.stdout, "buffer")
    if binary:
        sys.stdout.flush()

    def write(data: bytes | memoryview) -> None:
        if binary:
            sys.stdout.buffer.write(data)
        else:
            sys.stdout.write(bytes(data).decode())

    write(b"[")
    separator = b""
    for piece in text:
        if piece:
            write(separator)
            write(piece)
            separator = b","
    write(b"]\n")


def _nothing_matched(cfg: Any, only: dict[str, Any]) -> str:
    """Why ``--only`` kept no layout: a value the space does not list, else the combination."""
    for key, value in only.items():
        listed = cfg.space.values(key) if hasattr(cfg.space, key) else []
        if listed and value not in listed and not (key == "sp" and "auto" in listed):
            return f"--only: {key}={value} is not in the space (space.{key}: {listed}); no layout matched"
    wanted = ",".join(f"{k}={v}" for k, v in only.items())
    return f"--only: no layout of the space has {wanted} together (each value is listed; the world sizes or "\
           "other axes leave none)"


# -- trial --------------------------------------------------------------------------------------------------------
def cmd_trial(args: argparse.Namespace) -> int:
    from sweeper.config.schema import layout_from_string

    cfg = _load(args)
    check_address_override(cfg.cluster, args.address)
    layout = layout_from_string(cfg, args.layout)
    from sweeper.trial.single import run_single_trial

    result = run_single_trial(cfg, layout, out=args.out, address=args.address)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        from sweeper.ui.views import print_trial

        print_trial(cfg, layout, result)
    return EXIT_OK if result.passed else EXIT_FAILED


# -- migrate ------------------------------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    check_address_override(cfg.cluster, args.address)
    from sweeper.trial.migrate import default_out, migrate, parse_layouts

    source, target = parse_layouts(cfg, args.source, args.target)
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        raise UsageError(f"--checkpoint {args.checkpoint}: not a folder")
    out = args.out or default_out(cfg, source, target)
    result = migrate(cfg, source, target, out, checkpoint=args.checkpoint, address=args.address)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        from sweeper.ui.views import print_migration

        print_migration(result)
    return EXIT_OK if result.passed else EXIT_FAILED


# -- search -------------------------------------------------------------------------------------------------------
def cmd_search(args: argparse.Namespace) -> int:
    if args.max_trials is not None and args.max_trials < 1:
        raise UsageError(f"--max-trials: must be a positive integer, got {args.max_trials}")
    if args.parallel is not None and args.parallel < 1:
        raise UsageError(f"--parallel: must be a positive integer, got {args.parallel}")
    cfg = _load(args)
    check_address_override(cfg.cluster, args.address)
    from sweeper.search.command import run_search
    from sweeper.search.run.faults import parse_injections
    from sweeper.search.run.sweep import SearchOptions

    rehearse = _rehearsal(args)
    injections: list[Any] = []
    if not rehearse:
        parse_injections(args.inject, simulated=True)  # their syntax first: bad input is refused before any probing
        from sweeper.cluster import resolve_target

        # Which cluster, decided before the sweep folder and the MLflow store are written: an address that does not
        # answer ends here, with one line, after at most cluster.connect_timeout_s.
        target = resolve_target(cfg.cluster, args.address)
        if target.kind == "simulated":  # a resumed sweep too: it starts the same cluster (issue 54)
            from sweeper.trial.host import cpu_backend_refusal, simulated_capacity_refusal

            refusal = simulated_capacity_refusal(cfg) or cpu_backend_refusal(cfg)
            if refusal is not None:
                raise SweeperError(f"{args.space}: {refusal}", exit_code=EXIT_FAILED)
        injections = parse_injections(args.inject, simulated=target.kind == "simulated")
    options = SearchOptions(
        out=args.out or Path("sweeps") / (f"{cfg.name}-rehearsal" if rehearse else cfg.name),
        resume=args.resume,
        max_trials=args.max_trials,
        parallel=args.parallel,
        address=args.address,
        injections=injections,
        space=resolve_space_path(args.space),
        overrides=list(args.set),
        verbosity="verbose" if args.verbose else "quiet" if args.quiet else "normal",
        display=_live_display(args.quiet),
        rehearse=rehearse,
        rehearse_faults=args.rehearse_faults,
    )
    if args.break_lock:
        from sweeper.record.lock import LOCK_FILE, break_lock

        break_lock(options.out / LOCK_FILE, say=lambda line: print(line, file=sys.stderr, flush=True))
    return run_search(cfg, options)


def _rehearsal(args: argparse.Namespace) -> bool:
    """Whether ``search`` rehearses (``--rehearse``: no cluster is asked anything, the sweep runs against modelled
    trials); its options are checked here, before anything is written."""
    if not args.rehearse:
        if args.rehearse_faults is not None:
            raise UsageError("--rehearse-faults: only with --rehearse")
        return False
    from sweeper.trial.rehearsal import Faults

    for flag, given in (("--address", args.address), ("--inject", args.inject)):
        if given:
            raise UsageError(f"{flag}: a rehearsal runs no cluster (--rehearse-faults models faults)")
    Faults.parse(args.rehearse_faults)  # bad input refused before anything is written
    return True


def _live_display(quiet: bool) -> Any:
    """The live table of running trials on a terminal; None (plain progress lines) when stderr is not one."""
    if quiet or not sys.stderr.isatty():
        return None
    from sweeper.search.console import console
    from sweeper.ui.live import LiveTrials

    return LiveTrials(console.terminal)


# -- report -------------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    if not (args.dir / "trials.jsonl").is_file():
        raise UsageError(f"{args.dir}: not a sweep folder (no trials.jsonl)")
    from sweeper.report.render import render_report

    path = render_report(args.dir)
    print(path)
    return EXIT_OK


# -- replan -------------------------------------------------------------------------------------------------------
def cmd_replan(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top: must be a positive integer, got {args.top}")
    gpus, overrides = args.gpus, []
    for item in args.set:  # budget.gpus is N itself; the other budget fields go over the sweep's YAML
        name, _, value = item.partition("=")
        if name.strip() != "budget.gpus":
            overrides.append(item)
            continue
        try:
            given = int(value)
        except ValueError:
            raise UsageError(f"--set {item}: budget.gpus must be an integer") from None
        if gpus is not None and gpus != given:
            raise UsageError(f"--set {item}: contradicts --gpus {gpus}")
        gpus = given
    if gpus is None:
        raise UsageError("replan: --gpus N (or --set budget.gpus=N) is required")
    if args.out is not None and not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: no such folder {args.out.parent}")
    from sweeper.search.decide.replan import open_sweep, replan

    result = replan(open_sweep(args.dir, overrides), gpus, top=args.top)
    document = result.to_json()
    if args.out is not None:
        import yaml

        from sweeper.config.files import write_atomic

        text = (yaml.safe_dump(document, sort_keys=False, width=120) if args.out.suffix in (".yaml", ".yml")
                else json.dumps(document, indent=2) + "\n")
        write_atomic(args.out, text)
    if args.json:
        print(json.dumps(document))
    else:
        from sweeper.ui.views import print_replan

        print_replan(result, top=args.top)
        if args.out is not None:
            print(f"written: {args.out}", file=sys.stderr)
    return EXIT_OK


# -- doctor -------------------------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from sweeper.trial.single import run_doctor

    cfg = _load(args)
    check_address_override(cfg.cluster, args.address)
    report = run_doctor(cfg, address=args.address, trial_root=args.out or Path("sweeps") / cfg.name)
    from sweeper.ui.views import print_doctor

    print_doctor(report)
    return EXIT_OK if report.ok else EXIT_FAILED
