"""tokenbus core: configuration, IDs, topic names and the Kafka helpers both envs share."""
