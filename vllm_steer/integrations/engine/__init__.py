"""The engine-core process: the registry of loaded steers, run-time management, admission
(defaults, floors, binding each request's steers to their slots). Light: no torch at import
time."""
