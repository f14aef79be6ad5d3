"""`python -m meshws ...` is the `meshws` command."""

from .cli import main

main()
