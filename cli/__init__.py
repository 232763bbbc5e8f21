"""ptplan.cli: thin click commands that parse, validate, call one function and print."""
