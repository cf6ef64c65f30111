"""Write the generated reference pages, docs/search-yaml.md and docs/cli.md (sweeper/ui/reference.py makes them;
tests/test_reference_docs.py fails when a committed page is stale).

    python scripts/write_reference_docs.py
"""

from __future__ import annotations

from sweeper.cli import _parser
from sweeper.ui.reference import DOCS, cli_markdown, search_yaml_markdown


def main() -> None:
    (DOCS / "search-yaml.md").write_text(search_yaml_markdown())
    (DOCS / "cli.md").write_text(cli_markdown(_parser))
    print(f"wrote {DOCS / 'search-yaml.md'} and {DOCS / 'cli.md'}")


if __name__ == "__main__":
    main()
