"""What a run did, next to what its plan predicted: MFU, the memory verdict, plots and a summary page
(`orchestrate report RUN_DIR ...`)."""
