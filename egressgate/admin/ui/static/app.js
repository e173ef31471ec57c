// placeholder until the console front end lands (h14-uifront)
export {};
