"""The pslaunch launcher: the CLI and how processes are placed, started, watched and stopped."""
