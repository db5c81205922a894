"""Tool calls: the call formats of the common model families, rendering tools into a prompt,
reading calls back out of a reply, and the grammar that holds a required call to its format."""
