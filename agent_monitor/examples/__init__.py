"""Example runs the demo replays (plain recorded-run JSON); the robot run is generated with its
frames."""
