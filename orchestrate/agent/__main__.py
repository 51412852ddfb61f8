import os
import sys

from orchestrate.agent.process import main

code = main(int(sys.argv[1]))
# The run is over and the launcher has the reply: skip the interpreter's teardown, where native
# libraries the workers' modules loaded report on their own state (triton's nanobind "leaked
# instances" block) in lines a user cannot act on.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
