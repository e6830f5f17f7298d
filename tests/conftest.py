import os
import pathlib
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(pathlib.Path(__file__).parent))

# The default profile is deterministic and keeps no example database, so every
# run (a new user's, CI's) tries the same examples: HYPOTHESIS_PROFILE=random
# explores new ones, HYPOTHESIS_PROFILE=long explores ten times as many.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("random", database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", database=None, deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Dask workers sample every thread's stack (sys._current_frames) every 10 ms; on CPython 3.11 that
# sampling can deadlock with a thread being started while a garbage collection runs inside it (seen
# once in a full run: a worker's tclip pass stuck in Thread.start, the worker's main thread in Dask's
# GC callback inside _current_frames, the test waiting out its timeout). The tests' clusters have no
# use for the profiler: off, by the environment that spawned workers inherit (set before dask loads).
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False")

# transformers only ever loads local folders in these tests: never the network (set before it is imported)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
