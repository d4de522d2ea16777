"""The pass manager: finds the registered passes, reads pipeline text and presets, runs a pipeline and
verifies each pass's graph. It sits above every folder of passes; no pass imports it."""
