"""`python -m arlm` and the `arlm` console script."""

from . import prefer_huge_pages


def main() -> None:
    prefer_huge_pages()  # (before torch loads: arlm.cli imports it)
    from .cli import entry

    entry()


if __name__ == "__main__":
    main()
