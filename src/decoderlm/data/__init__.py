"""Corpora as token files (nanoGPT's `prepare.py` format), and batches of windows drawn from them.

`format`: the data directory on disk and its readers; `preparation`: `prepare`, text files into
a data directory; `batches`: `BatchSampler`, windows drawn from a split.
"""

from decoderlm.data.batches import BatchSampler, check_context_length
from decoderlm.data.format import (
    DATA_FILES,
    META_FILE,
    load_split,
    read_meta,
    read_text_file,
)
from decoderlm.data.preparation import (
    STDLIB_SKIP_DIRS,
    collect_files,
    prepare,
    prepare_default_corpus,
    stdlib_dir,
)

__all__ = [
    "DATA_FILES",
    "META_FILE",
    "STDLIB_SKIP_DIRS",
    "BatchSampler",
    "check_context_length",
    "collect_files",
    "load_split",
    "prepare",
    "prepare_default_corpus",
    "read_meta",
    "read_text_file",
    "stdlib_dir",
]
