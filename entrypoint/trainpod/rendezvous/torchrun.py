"""`python -m trainpod.rendezvous.torchrun ARGS`: torchrun that also knows `--rdzv-backend etcd-v3`.

It registers the etcd-v3 backend (trainpod.rendezvous.etcd_v3.register) and hands ARGS, exactly
torchrun's, to torch.distributed.run.main.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run

    from trainpod.rendezvous import etcd_v3

    etcd_v3.register()
    run.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
