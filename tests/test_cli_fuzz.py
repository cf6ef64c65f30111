"""Fuzzing bad input: generated malformed search YAMLs, ``--layout`` / ``--only`` strings and argument lists.

Every case holds at least one defect, and every one must end the same way: exit 2, one line on stderr that names
the field (or the argument, or the file), nothing on stdout, no traceback, nothing written. The CLI runs in this
process (``sweeper.cli.main``), so hundreds of cases take seconds. No case can start anything: the base YAML asks
for a simulated cluster (nothing is probed), every defect is one the command refuses before it would start work,
and a tripwire on the functions that start work fails the test if a case ever gets that far.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sweeper.cluster.connection
import sweeper.cluster.discovery
import sweeper.search.command
import sweeper.trial.single
from sweeper.cli import main
from sweeper.config.address import check_address
from sweeper.errors import LayoutError
from sweeper.space.axes import PRECISIONS
from sweeper.space.layout import canonical_recompute

GOOD: dict[str, Any] = {
    "name": "fuzz",
    "model": "tiny-gpt",
    "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_memory_gib": 4, "simulate": True},
    "training": {"seq_length": 64, "global_batch_size": 8, "steps": 4},
    "space": {"tp": [1, 2], "pp": [1, 2]},
}
TOTAL_GPUS = 4

SETTINGS = settings(
    max_examples=120,
    deadline=None,  # the first case of a command imports what it needs (ray, optuna)
    database=None,  # nothing written in the repository either
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- running one case -----------------------------------------------------------------------------------------------
class Launched(AssertionError):
    """A generated case got past validation to where a command starts work."""


@contextlib.contextmanager
def tripwire() -> Iterator[None]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise Launched("a malformed input reached the point where work starts")

    targets = [(sweeper.search.command, "run_search"), (sweeper.trial.single, "run_single_trial"),
               (sweeper.trial.single, "run_doctor"), (sweeper.cluster.connection, "connect"),
               (sweeper.cluster.discovery, "probe")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name, _ in saved:
        setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run_case(argv: list[str], workdir: Path, names: list[str]) -> str:
    """Run the CLI on ``argv`` in ``workdir``/cwd; assert the bad-input contract; return the error line."""
    cwd = workdir / "cwd"
    cwd.mkdir(exist_ok=True)
    before = tree(workdir)
    out, err = io.StringIO(), io.StringIO()
    with tripwire(), contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2, (argv, code, err.getvalue())
    assert len(lines) == 1, (argv, err.getvalue())
    assert "Traceback" not in err.getvalue()
    assert out.getvalue() == "", (argv, out.getvalue())
    assert any(name in lines[0] for name in names), (argv, names, lines[0])
    assert tree(workdir) == before, (argv, "wrote", sorted(set(tree(workdir)) - set(before)))
    return lines[0]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sweeper-fuzz-") as tmp:
        yield Path(tmp)


def write_space(workdir: Path, data: Any) -> Path:
    path = workdir / "space.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True))
    return path


# -- strategies: values that are wrong for a field of a given kind ----------------------------------------------------
text = st.text(max_size=12)
scalars = st.one_of(st.integers(), st.floats(), st.booleans(), text, st.none())
containers = st.one_of(st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


def _parses_as_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _is_number_text(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


BAD: dict[str, st.SearchStrategy[Any]] = {
    "posint": st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), text, st.none(), containers),
    "opt_posint": st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), text, containers),
    "nonneg_int": st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(), text, st.none(), containers),
    "int": st.one_of(st.booleans(), st.floats(), text, st.none(), containers),
    "posfloat": st.one_of(st.floats(max_value=0.0, allow_nan=False), non_finite, st.integers(max_value=0),
                          st.booleans(), text, st.none(), containers),
    "opt_posfloat": st.one_of(st.floats(max_value=0.0, allow_nan=False), non_finite, st.integers(max_value=0),
                              st.booleans(), text, containers),
    "nonneg_float": st.one_of(st.floats(max_value=-1e-9, allow_nan=False), non_finite, st.integers(max_value=-1),
                              st.booleans(), text, st.none(), containers),
    "ratio": st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9), non_finite, st.booleans(), text,
                       st.none(), containers),
    "bool": st.one_of(st.integers(), st.floats(), text, st.none(), containers),
    "simulate": st.one_of(st.integers(), st.floats(), text.filter(lambda t: t != "auto"), st.none(), containers),
    "compute_capability": st.one_of(text.filter(lambda t: not re.fullmatch(r"\d{1,2}\.\d", t)), st.integers(),
                                    st.booleans(), st.none()),
    "opt_str": st.one_of(st.integers(), st.floats(), st.booleans(), containers),
    "address": st.one_of(text.filter(lambda t: not _valid_address(t)), st.integers(), st.booleans(), st.none(),
                         containers),
    "str_list": st.one_of(st.integers(), text, st.lists(st.one_of(st.integers(), st.booleans(), st.none()),
                                                        min_size=1, max_size=3)),
    "name": st.one_of(text.filter(lambda t: not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", t)), st.integers(),
                      st.none(), containers),
    "parallel": st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), text.filter(lambda t: t != "auto"),
                          st.none(), containers),
    "model_posint": st.one_of(st.integers(max_value=0), st.booleans(), st.none(), non_finite,
                              st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
                              text.filter(lambda t: not _is_number_text(t)), containers),
}


def _valid_address(value: str) -> bool:
    try:
        check_address(value)
    except ValueError:
        return False
    return True


def _valid_recompute(value: str) -> bool:
    try:
        canonical_recompute(value)
    except LayoutError:
        return False
    return True


def _bad_list(item: st.SearchStrategy[Any], good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """An axis that is wrong: empty, not a list, or a list with at least one bad item among good ones."""
    with_bad = st.tuples(st.lists(good, max_size=3), item, st.integers(min_value=0, max_value=3)).map(
        lambda t: [*t[0][: t[2]], t[1], *t[0][t[2]:]])
    return st.one_of(st.just([]), with_bad, st.integers(), text, st.none())


posints = st.integers(min_value=1, max_value=8)
AXIS = _bad_list(BAD["posint"].filter(lambda v: v is not None), posints)
BAD.update({
    "axis": AXIS,
    "gpus": st.one_of(AXIS.filter(lambda v: v is not None),
                      st.lists(st.integers(min_value=TOTAL_GPUS + 1, max_value=10**6), min_size=1, max_size=2)),
    "sp_list": _bad_list(st.one_of(st.integers(), st.floats(), text.filter(lambda t: t != "auto"), st.none()),
                         st.sampled_from(["auto", True, False])),
    "precision_list": _bad_list(st.one_of(text.filter(lambda t: t not in PRECISIONS), st.integers(), st.none()),
                                st.sampled_from(PRECISIONS)),
    "recompute_list": _bad_list(st.one_of(text.filter(lambda t: not _valid_recompute(t)), st.integers()),
                                st.sampled_from(["none", "selective", "full"])),
    "bool_list": _bad_list(st.one_of(st.integers(), st.floats(), text, st.none()), st.booleans()),
    "objective": st.one_of(text.filter(lambda t: t not in ("tokens_per_s", "tflops_per_gpu")), st.integers(),
                           st.none()),
    "sampler": st.one_of(text.filter(lambda t: t not in ("auto", "ranked", "grid", "tpe", "random")), st.integers(), st.none()),
})

BAD["seeds"] = st.deferred(lambda: st.one_of(  # deferred: bad_assignments (--layout strings) is defined below
    st.tuples(st.lists(st.sampled_from(["tp=2", "pp=2", "tp=1,pp=2"]), max_size=2), bad_assignments()).map(
        lambda t: [*t[0], t[1]]),
    st.lists(st.one_of(st.integers(), st.booleans(), st.none()), min_size=1, max_size=2), st.integers(), text))

# (dotted field, kind of bad value). The model's fields are overrides of the tiny-gpt preset.
FIELDS: list[tuple[str, str]] = [
    ("name", "name"),
    ("cluster.nodes", "posint"), ("cluster.gpus_per_node", "posint"), ("cluster.gpu_memory_gib", "posfloat"),
    ("cluster.compute_capability", "compute_capability"), ("cluster.gpu_kind", "opt_str"),
    ("cluster.address", "address"), ("cluster.simulate", "simulate"), ("cluster.connect_timeout_s", "posfloat"),
    ("cluster.intra_node_bandwidth_gbs", "posfloat"), ("cluster.inter_node_bandwidth_gbs", "posfloat"),
    ("training.seq_length", "posint"), ("training.global_batch_size", "posint"), ("training.steps", "posint"),
    ("training.checkpoint", "bool"), ("training.checkpoint_every", "opt_posint"),
    ("training.trial_timeout_s", "posfloat"), ("training.warmup_steps", "nonneg_int"),
    ("training.data_paths", "str_list"), ("training.tokenizer_path", "opt_str"),
    ("space.gpus", "gpus"), ("space.tp", "axis"), ("space.pp", "axis"), ("space.vpp", "axis"), ("space.cp", "axis"),
    ("space.ep", "axis"), ("space.etp", "axis"), ("space.mbs", "axis"), ("space.sp", "sp_list"),
    ("space.precision", "precision_list"), ("space.recompute", "recompute_list"),
    ("space.distributed_optimizer", "bool_list"),
    ("search.max_trials", "posint"), ("search.parallel", "parallel"), ("search.objective", "objective"),
    ("search.memory_headroom", "ratio"), ("search.sampler", "sampler"), ("search.seed", "int"),
    ("search.confirm_top", "nonneg_int"), ("search.confirm_steps", "opt_posint"), ("search.seeds", "seeds"),
    ("search.wall_time_s", "opt_posfloat"), ("search.gpu_hours", "opt_posfloat"),
    ("tracking.mlflow_tracking_uri", "opt_str"), ("tracking.experiment", "opt_str"),
    ("estimate.allocator_fragmentation", "posfloat"), ("estimate.cuda_context_gib", "nonneg_float"),
    ("model.num_layers", "model_posint"), ("model.hidden_size", "model_posint"),
    ("model.num_attention_heads", "model_posint"), ("model.vocab_size", "model_posint"),
    ("model.moe_router_topk", "model_posint"),
]

# The keys a user may write, per section (what docs/ARCHITECTURE.md documents plus sweeper's additions).
KNOWN_KEYS: dict[str, set[str]] = {
    "": {"name", "model", "cluster", "training", "space", "search", "tracking", "estimate"},
    "cluster": {"nodes", "gpus_per_node", "gpu_memory_gib", "compute_capability", "gpu_kind", "address", "simulate",
                "connect_timeout_s", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs"},
    "training": {"seq_length", "global_batch_size", "steps", "checkpoint", "checkpoint_every", "trial_timeout_s",
                 "warmup_steps", "data_paths", "tokenizer_path"},
    "space": {"gpus", "tp", "pp", "vpp", "cp", "ep", "etp", "sp", "mbs", "precision", "recompute",
              "distributed_optimizer"},
    "search": {"max_trials", "parallel", "objective", "memory_headroom", "sampler", "seed", "seeds", "confirm_top",
               "confirm_steps", "wall_time_s", "gpu_hours"},
    "tracking": {"mlflow_tracking_uri", "experiment"},
}


def _known(section: str, key: str) -> bool:
    if section == "model":
        from sweeper.models.spec import ModelSpec

        return key in ModelSpec.model_fields or key in ("preset", "hf", "hf_config")
    if section == "estimate":
        from sweeper.config.estimator import EstimatorConstants

        return key in EstimatorConstants.model_fields
    return key in KNOWN_KEYS[section]


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    section, _, key = dotted.rpartition(".")
    if not section:
        out[key] = value
    elif section == "model":
        out["model"] = {"preset": "tiny-gpt", key: value}
    else:
        out[section] = {**out.get(section, {}), key: value}
    return out


@st.composite
def bad_field(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    dotted, kind = draw(st.sampled_from(FIELDS))
    return _set(GOOD, dotted, draw(BAD[kind])), dotted


@st.composite
def unknown_key(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    section = draw(st.sampled_from(["", "cluster", "training", "space", "search", "tracking", "estimate", "model"]))
    key = draw(st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True).filter(lambda k: not _known(section, k)))
    dotted = f"{section}.{key}" if section else key
    return _set(GOOD, dotted, draw(scalars)), dotted


@st.composite
def bad_section(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    section = draw(st.sampled_from(["cluster", "training", "space", "search", "tracking", "estimate"]))
    value = draw(st.one_of(st.integers(), st.floats(), st.booleans(), text, st.none(), st.lists(scalars, max_size=2)))
    return {**GOOD, section: value}, section


@st.composite
def bad_model(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    value = draw(st.one_of(
        text.filter(lambda t: t.strip() and t not in _presets()),  # an unknown preset
        st.integers(), st.floats(allow_nan=False), st.booleans(), st.lists(scalars, max_size=2),
        st.fixed_dictionaries({"hf_config": st.from_regex(r"[a-z]{1,8}\.json", fullmatch=True)}),  # a missing file
        st.fixed_dictionaries({"num_layers": posints, "hidden_size": posints}),  # required fields missing
    ))
    return {**GOOD, "model": value}, "model"


def _presets() -> set[str]:
    from sweeper.models.catalog import PRESETS

    return set(PRESETS)


# -- strategies: --layout / --only strings with at least one bad item -------------------------------------------------
GOOD_ITEMS = ["tp=1", "pp=1", "mbs=1", "sp=false", "precision=bf16", "recompute=none", "cp=1", "ep=1", "vpp=1"]
INT_KEYS = ["gpus", "tp", "pp", "vpp", "cp", "dp", "ep", "etp", "edp", "mbs", "gbs"]
item_text = st.text(alphabet=st.characters(blacklist_characters=",="), max_size=8)


def _is_positive_int(raw: str) -> bool:
    return raw.strip().isascii() and raw.strip().isdigit() and int(raw.strip()) >= 1


bad_item = st.one_of(
    item_text.filter(lambda t: "=" not in t and t.strip() != ""),  # not key=value
    st.from_regex(r"[a-z_]{1,10}", fullmatch=True).filter(
        lambda k: k not in (*INT_KEYS, "sp", "distributed_optimizer", "precision", "recompute")
    ).map(lambda k: f"{k}=1"),
    st.tuples(st.sampled_from(INT_KEYS), st.one_of(
        item_text.filter(lambda t: not _is_positive_int(t)),
        st.sampled_from(["0", "-1", "1.5", "+2", "2_0", "0x10", "1e3", "²", "٣", "", " "]),  # "²" and "٣" are isdigit()
    )).map("=".join),
    st.tuples(st.sampled_from(["sp", "distributed_optimizer"]), item_text.filter(
        lambda t: t.strip().lower() not in ("true", "false", "1", "0", "on", "off", "yes", "no", "auto")
    )).map("=".join),
    item_text.filter(lambda t: t.strip().lower() not in PRECISIONS).map(lambda t: f"precision={t}"),
    item_text.filter(lambda t: not _valid_recompute(t.strip().lower())).map(lambda t: f"recompute={t}"),
    st.integers(min_value=TOTAL_GPUS + 1, max_value=10**9).map(lambda n: f"gpus={n}"),  # more GPUs than the cluster
)


@st.composite
def bad_assignments(draw: st.DrawFn, *, only: bool = False) -> str:
    """A --layout string (or, with ``only``, an --only filter, for which a world size no layout has is no error)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["", " ", ",", ",,", "tp=1,", ",tp=1", "tp=1,,pp=1", "tp=1,tp=2"]))
    good = draw(st.lists(st.sampled_from(GOOD_ITEMS), max_size=3, unique_by=lambda i: i.split("=")[0]))
    bad = draw(bad_item.filter(lambda item: not (only and item.startswith("gpus="))))
    if bad.split("=")[0].strip().lower() in {g.split("=")[0] for g in good}:
        good = [g for g in good if g.split("=")[0] != bad.split("=")[0].strip().lower()]
    position = draw(st.integers(0, len(good)))
    return ",".join([*good[:position], bad, *good[position:]])


# -- strategies: argument lists ---------------------------------------------------------------------------------------
OPTIONS = {
    "plan": ["--json", "--only", "--limit"],
    "trial": ["--layout", "--json", "--out", "--address"],
    "search": ["--resume", "--out", "--max-trials", "--parallel", "--address", "--inject"],
    "doctor": ["--address"],
    "report": [],
}
INJECT = r"(node-loss|node-join|hang|nan|kill-rank)@trial=0*[1-9][0-9]*"
not_int_text = text.filter(lambda t: not _parses_as_int(t))


@st.composite
def bad_argv(draw: st.DrawFn, space: str, missing: str) -> tuple[list[str], list[str]]:
    """An argument list with at least one defect, and the names any of which the error line may carry."""
    command = draw(st.sampled_from(["plan", "trial", "search", "doctor", "report", "nocommand", "unknown"]))
    if command == "nocommand":
        return [], ["command"]
    if command == "unknown":
        word = draw(st.from_regex(r"[a-z]{1,10}", fullmatch=True).filter(lambda w: w not in OPTIONS))
        return [word, space], ["invalid choice"]
    if command == "report":
        return ["report", draw(st.sampled_from([missing, str(Path(space).parent)]))], ["not a sweep folder"]
    defects: list[tuple[list[str], list[str]]] = []
    choices = ["missing_space", "unknown_option", "no_such_file"]
    choices += {"plan": ["only", "limit"], "trial": ["layout", "address", "no_layout"],
                "search": ["max_trials", "parallel", "inject", "address"], "doctor": ["address"]}[command]
    for kind in draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3, unique=True)):
        defects.append(_defect(draw, command, kind, space, missing))
    argv: list[str] = [command]
    positional = space
    names: list[str] = []
    for args, defect_names in defects:
        names += defect_names
        if args == ["<missing>"]:
            positional = None
        elif args == ["<no-such-file>"]:
            positional = missing
        else:
            argv += args
    if command == "trial" and not any(a.startswith("--layout") for a in argv) and "no_layout" not in names:
        argv += ["--layout=tp=1"]
    if "no_layout" in names:
        names.append("--layout")
    if positional is not None:
        argv.insert(1, positional)
    return argv, names


def _defect(draw: st.DrawFn, command: str, kind: str, space: str, missing: str) -> tuple[list[str], list[str]]:
    if kind == "missing_space":
        return ["<missing>"], ["space", "required"]
    if kind == "no_such_file":
        return ["<no-such-file>"], ["no such file"]
    if kind == "unknown_option":
        # argparse takes any unambiguous prefix of a known option: a generated one must not be one
        known = OPTIONS[command] + ["--help"]
        word = draw(st.from_regex(r"--[a-z][a-z-]{0,10}", fullmatch=True).filter(
            lambda w: not any(k.startswith(w) for k in known)))
        return [word], ["unrecognized arguments"]
    if kind == "only":
        return [f"--only={draw(bad_assignments(only=True))}"], ["--only"]
    if kind == "layout":
        return [f"--layout={draw(bad_assignments())}"], ["--layout"]
    if kind == "no_layout":
        return [], ["no_layout"]
    if kind == "limit":
        return [f"--limit={draw(st.one_of(st.integers(max_value=-1).map(str), not_int_text))}"], ["--limit"]
    if kind in ("max_trials", "parallel"):
        option = "--" + kind.replace("_", "-")
        return [f"{option}={draw(st.one_of(st.integers(max_value=0).map(str), not_int_text))}"], [option]
    if kind == "inject":
        spec = draw(text.filter(lambda t: not re.fullmatch(INJECT, t.strip())))
        return [f"--inject={spec}"], ["--inject"]
    # address: malformed, or any address at all for the base YAML's simulate: true cluster
    value = draw(st.one_of(text.filter(lambda t: t != "auto"),
                           st.sampled_from(["127.0.0.1:6379", "local", "ray://127.0.0.1:10001"])))
    return [f"--address={value}"], ["--address"]


# -- the tests --------------------------------------------------------------------------------------------------------
COMMANDS = [["plan"], ["trial", "--layout=tp=1"], ["search"], ["doctor"]]


@SETTINGS
@given(case=st.one_of(bad_field(), unknown_key(), bad_section(), bad_model()), command=st.sampled_from(COMMANDS))
def test_malformed_yaml_fields(workdir: Path, case: tuple[dict[str, Any], str], command: list[str]) -> None:
    data, field = case
    space = write_space(workdir, data)
    line = run_case([command[0], str(space), *command[1:]], workdir, [field])
    assert line.startswith(f"error: {space}: "), line


def _alias_document(key: str, shape: str) -> str:
    """A YAML whose ``key`` is an alias to a list holding itself, or to 10**9 leaves once expanded."""
    if shape == "self":
        return f"name: t\nmodel: tiny-gpt\n{key}: &a [*a]\n"
    levels = "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}" if i else "1"] * 10) + "]\n" for i in range(9))
    return f"name: t\nmodel: tiny-gpt\n{levels}{key}: *a8\n"


alias_documents = st.builds(_alias_document, st.sampled_from(["name", "model", "cluster", "space", "training",
                                                              "search", "estimate", "x"]),
                            st.sampled_from(["self", "bomb"]))


@settings(SETTINGS, max_examples=60)
@given(raw=st.one_of(st.text(max_size=80), st.binary(max_size=40), alias_documents,
                     st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                   st.dictionaries(text, inner, max_size=3)),
                                  max_leaves=8).map(lambda v: yaml.safe_dump(v))))
def test_malformed_yaml_documents(workdir: Path, raw: str | bytes) -> None:
    space = write_space(workdir, raw)
    run_case(["plan", str(space)], workdir, [f"error: {space}: "])


@SETTINGS
@given(data=st.data(), option=st.sampled_from(["--layout", "--only"]))
def test_malformed_layout_strings(workdir: Path, data: st.DataObject, option: str) -> None:
    space = write_space(workdir, GOOD)
    if option == "--layout":
        argv = ["trial", str(space), f"--layout={data.draw(bad_assignments())}"]
    else:
        argv = ["plan", str(space), f"--only={data.draw(bad_assignments(only=True))}"]
    run_case(argv, workdir, [option])


@settings(SETTINGS, max_examples=150)
@given(data=st.data())
def test_malformed_argument_lists(workdir: Path, data: st.DataObject) -> None:
    space = write_space(workdir, GOOD)
    argv, names = data.draw(bad_argv(str(space), str(workdir / "missing.yaml")))
    run_case(argv, workdir, names)
