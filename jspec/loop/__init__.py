"""The device loop: the draft -> verify -> accept step (step.py) and the two loops that run it
inside one jitted program: the wave loop (waves.py) and continuous batching's rounds
(slots.py, queue.py, rounds.py, dispatch.py). jspec.schedulers drives them from the host;
jspec.speculative is what a step speculates with (drafters, verification, sampling)."""
