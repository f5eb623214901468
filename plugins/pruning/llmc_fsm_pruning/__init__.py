"""llmc-fsm pruning plugin."""
