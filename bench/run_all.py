"""Run the whole benchmark suite and write the report (the same command as `diloco bench`).

python bench/run_all.py            # full suite into docs/benchmarks (about 15 minutes on 2 cores)
python bench/run_all.py --quick    # CI variant into a temp dir (about 2 minutes)
python bench/run_all.py --only cluster --out docs/benchmarks
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diloco.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
