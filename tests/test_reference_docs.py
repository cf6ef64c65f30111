"""The generated reference pages are what the code says now: docs/search-yaml.md (every key of the search YAML, from
the pydantic types) and docs/cli.md (every command and option, from the parser)."""

from __future__ import annotations

from sweeper.cli import _parser
from sweeper.config.schema import ClusterConfig, SearchConfig, SweepConfig, TrainingConfig
from sweeper.ui.reference import DOCS, cli_markdown, search_yaml_markdown

REGENERATE = "stale: run `python scripts/write_reference_docs.py` and commit docs/"


def test_the_search_yaml_reference_is_current() -> None:
    assert (DOCS / "search-yaml.md").read_text() == search_yaml_markdown(), REGENERATE


def test_the_cli_reference_is_current() -> None:
    assert (DOCS / "cli.md").read_text() == cli_markdown(_parser), REGENERATE


def test_every_key_of_the_search_yaml_is_described() -> None:
    page = search_yaml_markdown()
    for section, model in (("cluster", ClusterConfig), ("training", TrainingConfig), ("search", SearchConfig)):
        for name, info in model.model_fields.items():
            assert info.description, f"{section}.{name} has no description (a docstring under the field)"
            assert f"| `{section}.{name}` |" in page
    assert all(SweepConfig.model_fields[k].description for k in ("name", "model", "run", "budget"))
    # Keys the README never documented before the page existed.
    for key in ("cluster.intra_node_bandwidth_gbs", "training.warmup_steps", "training.checkpoint_every",
                "training.data_paths", "search.seeds", "training.tokenizer_path", "search.seed", "search.wall_time_s"):
        assert f"| `{key}` |" in page, key
    assert "`rtx-pro-6000`" in page and "`llama3.1-405b`" in page


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    page = cli_markdown(_parser)
    for command in ("plan", "trial", "migrate", "search", "report", "doctor"):
        assert f"## sweeper {command}\n" in page
    for option in ("--limit", "--set", "--address", "--resume", "--max-trials", "--proxy", "--json", "--only"):
        assert option in page, option
