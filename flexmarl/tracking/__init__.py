"""Optional experiment tracking (TensorBoard, MLflow) of each agent update, from the driver."""
