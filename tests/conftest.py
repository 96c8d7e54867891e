import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two pytest processes on 2 cores: one torch thread per process (and per `laminar`
# subprocess, which inherits it) instead of oversubscribed threads that spin against each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
