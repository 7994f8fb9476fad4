"""What a user watches: the progress display, the JSON Lines run log, the W&B logger, GPU statistics, the
memory table and the SOL/MFU figures. Reads the run's records; never drives training.
"""
