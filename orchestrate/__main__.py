from orchestrate.cli import main

main()
