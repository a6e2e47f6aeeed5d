from systolic.cli import entry

entry()
