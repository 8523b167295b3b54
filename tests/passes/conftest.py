import os
from pathlib import Path

# Inductor's on-disk cache inside the repo (git-ignored): recompiling the same graphs is quick.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[2] / ".inductor-cache"))
