import logging
import os
import sys

from orchestrate.worker.main import main

code = main()
# Leave without running C++ static destructors: under load, a gloo rank tearing its process group
# down at interpreter exit while a peer is already gone aborts now and then ("terminate called
# without an active exception", exit -6, after the run has finished:
# docs/measurements.md#worker__main__py). Everything is saved and closed by now (model, checkpoints,
# metrics, trackers: train() returned); only the streams and logging need flushing.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
