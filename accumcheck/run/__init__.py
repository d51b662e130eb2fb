"""Running a check: its configuration, the backend interface and registry, faults, resources, processes and the user's model and setup file."""
