"""The `tandem` command line and the Gradio playground mounted on the OpenAI server."""
