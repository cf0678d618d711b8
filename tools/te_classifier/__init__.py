"""Training and drift-evaluation scripts of the demo classifier; the model's data readers and shipped files stay in
models/te_classifier/."""
