// placeholder: replaced by the runtime/config work
int main() { return 0; }
