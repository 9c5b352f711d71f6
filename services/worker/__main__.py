"""`python -m services.worker` / `diloco worker`: run one learner until training finishes or SIGTERM."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

import torch

from diloco import log as logging
from diloco.errors import ConfigError
from services.worker.config import parse
from services.worker.worker import Worker


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse(argv)
    except ConfigError as e:
        print(f"diloco worker: configuration error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    logging.configure("worker")
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
