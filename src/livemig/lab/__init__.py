"""The lab: boots guests on this machine or the testbed and hands them to the engine."""
