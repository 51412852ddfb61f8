import sys

from orchestrate.worker.main import main

sys.exit(main())
