"""Tools around nodes: starting real node processes (`launch`), a whole local mesh
(`local_mesh`, what `meshws mesh` and `./dev mesh` run) and the benchmark (`bench`).

Imports: anything of meshws; nothing imports these but the CLI and the tests.
"""
