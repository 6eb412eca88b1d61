"""`python -m trainpod.agent ARGS`: torchrun's arguments (trainpod.agent.agent)."""

import sys

from trainpod.agent.agent import main

# Guarded: a forked rank's start (multiprocessing's forkserver) runs the parent's __main__ module again as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
