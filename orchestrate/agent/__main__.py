import sys

from orchestrate.agent.process import main

sys.exit(main(int(sys.argv[1])))
