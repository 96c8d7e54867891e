"""In-memory DuckDB connections for curation queries.

DuckDB spills large joins to ``temp_directory``, which defaults to ``.tmp`` in the working
directory; these connections spill into a private temporary folder instead, removed on close.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref


def memory_db():
    import duckdb

    scratch = tempfile.mkdtemp(prefix="laminar-duckdb-")
    con = duckdb.connect(":memory:", config={"temp_directory": scratch})
    weakref.finalize(con, shutil.rmtree, scratch, True)
    return con
