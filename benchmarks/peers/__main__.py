"""``python benchmarks/peers``: the peers benchmark (see the package docstring)."""

import sys
from pathlib import Path

# benchmarks/ on the path: results.py, and this directory as the package ``peers``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers.cli import main

sys.exit(main())
