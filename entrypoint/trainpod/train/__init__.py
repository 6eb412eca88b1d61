"""The library a training script imports: what runs inside the ranks.

progress.py (steps and committed checkpoints, read by the agent's budget and hang watch),
checkpoint/ (atomic, verified checkpoints that load without running code), distributed.py,
inprocess.py (in-process recovery), preemption.py (SIGTERM: finish the step, checkpoint, exit),
samplers.py (exactly-once sampling across world sizes), rng.py. The bundled examples (trainpod.examples)
use nothing else; a user's script may use any of it, or none.
"""
