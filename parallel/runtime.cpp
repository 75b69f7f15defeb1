// parallel runtime: being written
